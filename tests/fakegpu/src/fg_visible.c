/* fakegpu: FAKEGPU_VISIBLE_DEVICES, the simulator's stand-in for what the NVIDIA container
 * toolkit does with NVIDIA_VISIBLE_DEVICES (it mounts only the chosen GPUs' device nodes, so
 * both CUDA and NVML inside the container see only those).  Unset or "all": every device;
 * "none", "void" or empty: none; else a comma list of state indices and/or full UUIDs. */
#include "fg_state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int fg_visible_map(const struct fg_state *st, int map[FG_MAX_DEV])
{
    const char *v = getenv("FAKEGPU_VISIBLE_DEVICES");
    int n = 0;
    if (!v || !strcmp(v, "all")) {
        for (unsigned i = 0; i < st->h.ndev; i++)
            map[n++] = (int)i;
        return n;
    }
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", v);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int found = -1;
        char *end;
        long x = strtol(tok, &end, 10);
        if (end != tok && *end == '\0') {
            if (x >= 0 && x < (long)st->h.ndev)
                found = (int)x;
        } else {
            for (unsigned i = 0; i < st->h.ndev; i++)
                if (!strcmp(st->cfg[i].uuid, tok))
                    found = (int)i;
        }
        for (int j = 0; j < n && found >= 0; j++)
            if (map[j] == found)
                found = -1;
        if (found >= 0 && n < FG_MAX_DEV)
            map[n++] = found;
    }
    return n;
}
