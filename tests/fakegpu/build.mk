# tests/fakegpu: the simulated NVIDIA driver (libcuda.so.1, libnvidia-ml.so.1, fakegpu-ctl,
# fakegpu-burn).  Outputs go to $(BUILD)/fakegpu/.  The libraries are linked -Bsymbolic so their
# internal references (cuGetProcAddress's table above all) never bind to an interposer.
FG_SRC   := tests/fakegpu/src
FG_OUT   := $(BUILD)/fakegpu
FG_HDRS  := $(wildcard $(FG_SRC)/*.h)
FG_CORE  := $(FG_SRC)/fg_state.c $(FG_SRC)/fg_config.c $(FG_SRC)/fg_sim.c $(FG_SRC)/fg_pid.c \
            $(FG_SRC)/fg_visible.c $(FG_SRC)/fg_live.c
FG_CUDA  := $(FG_CORE) $(wildcard $(FG_SRC)/cuda_*.c)
FG_NVML  := $(FG_CORE) $(wildcard $(FG_SRC)/nvml_*.c)
FG_LDLIB := -shared -Wl,-Bsymbolic -Wl,-z,defs -Wl,--no-undefined

ALL_TARGETS += $(FG_OUT)/libcuda.so.1 $(FG_OUT)/libcuda.so $(FG_OUT)/libnvidia-ml.so.1 \
               $(FG_OUT)/libnvidia-ml.so $(FG_OUT)/fakegpu-ctl $(FG_OUT)/fakegpu-burn

$(FG_OUT):
	mkdir -p $@

$(FG_OUT)/libcuda.so.1: $(FG_CUDA) $(FG_HDRS) tests/fakegpu/build.mk | $(FG_OUT)
	$(CC) $(CFLAGS_LIB) $(FG_LDLIB) -Wl,-soname,libcuda.so.1 -o $@ $(FG_CUDA) -lpthread

$(FG_OUT)/libnvidia-ml.so.1: $(FG_NVML) $(FG_HDRS) tests/fakegpu/build.mk | $(FG_OUT)
	$(CC) $(CFLAGS_LIB) $(FG_LDLIB) -Wl,-soname,libnvidia-ml.so.1 -o $@ $(FG_NVML) -lpthread

$(FG_OUT)/libcuda.so: $(FG_OUT)/libcuda.so.1
	ln -sf libcuda.so.1 $@

$(FG_OUT)/libnvidia-ml.so: $(FG_OUT)/libnvidia-ml.so.1
	ln -sf libnvidia-ml.so.1 $@

$(FG_OUT)/fakegpu-ctl: $(FG_SRC)/ctl.c $(FG_CORE) $(FG_HDRS) tests/fakegpu/build.mk | $(FG_OUT)
	$(CC) $(CFLAGS_PROG) -o $@ $(FG_SRC)/ctl.c $(FG_CORE) -lpthread

# Linked against the fake's libcuda.so; at run time it takes whichever libcuda.so.1 the loader
# finds (LD_LIBRARY_PATH=build/fakegpu for the simulator, the real driver on a GPU node).
$(FG_OUT)/fakegpu-burn: $(FG_SRC)/burn.c $(FG_OUT)/libcuda.so tests/fakegpu/build.mk | $(FG_OUT)
	$(CC) $(CFLAGS_PROG) -o $@ $(FG_SRC)/burn.c -L$(FG_OUT) -lcuda

# The simulated NVIDIA container toolkit (tests/fakegpu/toolkit, standard-library Python run by
# the system python3): nvidia-container-runtime (+ .legacy, .cdi: the mode forced by the name),
# nvidia-container-runtime-hook, fakegpu-cdi.  docs/fakegpu.md "The simulated container toolkit".
FG_TK_SRC := tests/fakegpu/toolkit
FG_TK     := nvidia-container-runtime nvidia-container-runtime-hook fakegpu-cdi
ALL_TARGETS += $(addprefix $(FG_OUT)/,$(FG_TK) fgtoolkit.py nvidia-container-runtime.legacy \
               nvidia-container-runtime.cdi)

$(FG_OUT)/fgtoolkit.py: $(FG_TK_SRC)/fgtoolkit.py | $(FG_OUT)
	install -m 0644 $< $@

$(addprefix $(FG_OUT)/,$(FG_TK)): $(FG_OUT)/%: $(FG_TK_SRC)/% | $(FG_OUT)
	install -m 0755 $< $@

$(FG_OUT)/nvidia-container-runtime.legacy $(FG_OUT)/nvidia-container-runtime.cdi: $(FG_OUT)/nvidia-container-runtime
	ln -sf nvidia-container-runtime $@
