/* log.h — libvgpu.so logging: stderr only, never stdout, level from VGPU_LOG_LEVEL. */
#ifndef VGPU_LOG_H
#define VGPU_LOG_H

enum vgpu_log_level { VGPU_LOG_OFF = 0, VGPU_LOG_ERROR = 1, VGPU_LOG_WARN = 2, VGPU_LOG_INFO = 3, VGPU_LOG_DEBUG = 4 };

extern int vgpu_log_level;

/* Read VGPU_LOG_LEVEL (off|error|warn|info|debug or 0-4).  Default: error —
 * nothing is printed in normal operation; only a fail-closed condition
 * (bad limits file, unusable region) prints its one line. */
void vgpu_log_init(void);
void vgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define VLOG(lvl, ...)                                   \
    do {                                                 \
        if (__builtin_expect(vgpu_log_level >= (lvl), 0)) \
            vgpu_log((lvl), __VA_ARGS__);                \
    } while (0)

#endif
