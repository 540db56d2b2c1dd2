/* log.c — one line per message, written with a single write(2) to fd 2. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int vgpu_log_level = VGPU_LOG_ERROR;

void vgpu_log_init(void)
{
    const char *v = getenv("VGPU_LOG_LEVEL");
    if (!v || !*v)
        return;
    static const char *names[] = {"off", "error", "warn", "info", "debug"};
    for (int i = 0; i < 5; i++) {
        if (strcasecmp(v, names[i]) == 0 || (v[0] == '0' + i && v[1] == '\0')) {
            vgpu_log_level = i;
            return;
        }
    }
    if (strcasecmp(v, "none") == 0 || strcasecmp(v, "quiet") == 0)
        vgpu_log_level = VGPU_LOG_OFF;
}

void vgpu_log(int level, const char *fmt, ...)
{
    static const char *tags[] = {"", "error", "warn", "info", "debug"};
    char buf[512];
    if (level < VGPU_LOG_ERROR || level > VGPU_LOG_DEBUG)
        level = VGPU_LOG_ERROR;
    int n = snprintf(buf, sizeof buf, "vgpu[%d]: %s: ", (int)getpid(), tags[level]);
    if (n < 0 || (size_t)n >= sizeof buf)
        return;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0)
        return;
    size_t len = (size_t)n + (size_t)m;
    if (len > sizeof buf - 2)
        len = sizeof buf - 2;
    buf[len++] = '\n';
    ssize_t w = write(2, buf, len);
    (void)w;
}
