# libcuda_intercept: build/libvgpu.so, its ASan+UBSan twin, and the C test programs.
VGPU_SRCS := $(wildcard libcuda_intercept/src/*.c)
VGPU_HDRS := $(wildcard libcuda_intercept/src/*.h) libcuda_intercept/include/vgpu_region.h
VGPU_LDFLAGS := -shared -Wl,-Bsymbolic -Wl,--no-undefined -Wl,-z,now -Wl,--no-as-needed -l:libdl.so.2 -lpthread
VGPU_ASAN := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
# weak references alone would let the linker drop DT_NEEDED libcuda.so.1
INTERCEPT_LINK_CUDA := -L$(BUILD)/intercept/stub -Wl,--no-as-needed -lcuda
INTERCEPT_TESTS_SRC := $(wildcard tests/libcuda_intercept/c/*.c)
INTERCEPT_TEST_BINS := $(patsubst tests/libcuda_intercept/c/%.c,$(BUILD)/intercept/%,$(filter-out tests/libcuda_intercept/c/common.c tests/libcuda_intercept/c/stubcuda.c tests/libcuda_intercept/c/reenter_driver.c,$(INTERCEPT_TESTS_SRC)))

ALL_TARGETS += $(BUILD)/libvgpu.so $(BUILD)/intercept/libvgpu-asan.so $(BUILD)/intercept/stub/libcuda.so.1 \
               $(INTERCEPT_TEST_BINS)

$(BUILD)/libvgpu.so: $(VGPU_SRCS) $(VGPU_HDRS) | $(BUILD)
	$(CC) $(CFLAGS_LIB) -o $@ $(VGPU_SRCS) $(VGPU_LDFLAGS)

$(BUILD)/intercept/libvgpu-asan.so: $(VGPU_SRCS) $(VGPU_HDRS)
	@mkdir -p $(@D)
	$(CC) $(CSTD) $(CWARN) -O1 -g -fPIC -fvisibility=hidden $(VGPU_ASAN) -o $@ $(VGPU_SRCS) $(VGPU_LDFLAGS)

# A link-time stand-in for libcuda.so.1 (soname libcuda.so.1), so the "linked
# -lcuda" test programs build without the simulator or a driver; at run time
# the real driver or build/fakegpu/libcuda.so.1 is found via LD_LIBRARY_PATH.
$(BUILD)/intercept/stub/libcuda.so.1: tests/libcuda_intercept/c/stubcuda.c
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_LIB) -shared -Wl,-soname,libcuda.so.1 -o $@ $<
	ln -sf libcuda.so.1 $(@D)/libcuda.so

$(BUILD)/intercept/%: tests/libcuda_intercept/c/%.c $(INTERCEPT_TESTS_SRC) $(wildcard tests/libcuda_intercept/c/*.h) \
                      $(BUILD)/intercept/stub/libcuda.so.1 libcuda_intercept/src/cuda_abi.h
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_PROG) -Ilibcuda_intercept/src -Ilibcuda_intercept/include -o $@ $< tests/libcuda_intercept/c/common.c \
	    $(if $(filter link_%,$*),$(INTERCEPT_LINK_CUDA),) -ldl -lpthread

.PHONY: test-asan
test-asan: venv build-all
	$(PY) -m pytest -q tests/libcuda_intercept -k asan

# the library's own limits parser, standalone (cross-checked against vgpu/limits.py)
$(BUILD)/intercept/limits_check: tests/libcuda_intercept/c/limits_check.c libcuda_intercept/src/vlimits.c \
                                 libcuda_intercept/src/vlimits.h
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_PROG) -Ilibcuda_intercept/src -o $@ $< libcuda_intercept/src/vlimits.c

# a test driver in front of the simulator that re-enters the exported API (tests/libcuda_intercept/test_reentry.py)
ALL_TARGETS += $(BUILD)/intercept/reenter/libcuda.so.1
$(BUILD)/intercept/reenter/libcuda.so.1: tests/libcuda_intercept/c/reenter_driver.c libcuda_intercept/src/cuda_abi.h
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_LIB) -Ilibcuda_intercept/src -shared -Wl,-soname,libcuda.so.1 -o $@ $< -ldl -lpthread
