/* limits_check FILE — parse a limits file with libvgpu.so's own parser:
 * "ok N" + one "dev ..." line per device, or "error MESSAGE" (exit 1). */
#include <stdio.h>

#include "vlimits.h"

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: limits_check FILE\n");
        return 2;
    }
    struct vgpu_limits l;
    char err[300];
    int rc = vgpu_limits_load(argv[1], &l, err, sizeof err);
    if (rc != 0) {
        printf("error %s\n", rc > 0 ? "does not exist" : err);
        return 1;
    }
    printf("ok %u\n", l.count);
    for (unsigned i = 0; i < l.count; i++)
        printf("dev %s %llu %u %d %llu\n", l.dev[i].uuid, (unsigned long long)l.dev[i].memory_limit,
               l.dev[i].core_percent, l.dev[i].oversubscribe, (unsigned long long)l.dev[i].device_limit);
    return 0;
}
