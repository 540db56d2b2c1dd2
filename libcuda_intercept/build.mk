# libcuda_intercept: build/libvgpu.so and its test programs.
# Filled in by the intercept work.
