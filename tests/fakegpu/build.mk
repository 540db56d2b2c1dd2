# tests/fakegpu: the simulated NVIDIA driver (libcuda.so.1, libnvidia-ml.so.1, fakegpu-ctl).
# Filled in by the fakegpu work; outputs go to $(BUILD)/fakegpu/.
