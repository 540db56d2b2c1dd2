/* fakegpu: FAKEGPU_VISIBLE_DEVICES, the simulator's stand-in for what the NVIDIA container
 * toolkit does with NVIDIA_VISIBLE_DEVICES (it mounts only the chosen GPUs' device nodes, so
 * both CUDA and NVML inside the container see only those).  Unset or "all": every device;
 * "none", "void" or empty: none; a path (starts with '/'): a device directory, the devices whose
 * `<dir>/nvidia<minor_number>` exists -- what the simulated toolkit (sim/fakegpu/toolkit) sets,
 * as the real driver sees only the GPUs whose device nodes the container has; else a comma list
 * of state indices and/or full UUIDs.
 *
 * fg_env(): the FAKEGPU_* variables come from the environment, else from the driver file
 * FG_DRIVER_ENV (`KEY=VALUE` lines) -- the simulated toolkit's legacy hook cannot change a
 * container's environment (neither can NVIDIA's), so it bind-mounts that file instead. */
#include "fg_state.h"
#include "fg_mig.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FG_DRIVER_ENV "/etc/fakegpu/driver.env"
#define FG_DRIVER_MAX 8

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static char g_keys[FG_DRIVER_MAX][64];
static char g_vals[FG_DRIVER_MAX][1024];
static int g_n;

static void load_driver_file(void)
{
    FILE *f = fopen(FG_DRIVER_ENV, "re");
    if (!f)
        return;
    char line[1200];
    while (g_n < FG_DRIVER_MAX && fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\r\n")] = '\0';
        char *eq = strchr(line, '=');
        if (line[0] == '#' || !eq || eq == line || (size_t)(eq - line) >= sizeof(g_keys[0]))
            continue;
        size_t kl = (size_t)(eq - line), vl = strlen(eq + 1);
        if (vl >= sizeof(g_vals[0]))
            continue;
        memcpy(g_keys[g_n], line, kl);
        g_keys[g_n][kl] = '\0';
        memcpy(g_vals[g_n], eq + 1, vl + 1);
        g_n++;
    }
    fclose(f);
}

const char *fg_env(const char *name)
{
    const char *v = getenv(name);
    if (v)
        return v;
    pthread_once(&g_once, load_driver_file);
    for (int i = 0; i < g_n; i++)
        if (!strcmp(g_keys[i], name))
            return g_vals[i];
    return NULL;
}

int fg_visible_map(const struct fg_state *st, int map[FG_MAX_DEV])
{
    const char *v = fg_env("FAKEGPU_VISIBLE_DEVICES");
    int n = 0;
    if (!v || !strcmp(v, "all")) {
        for (unsigned i = 0; i < st->h.ndev; i++)
            map[n++] = (int)i;
        return n;
    }
    if (v[0] == '/') {
        for (unsigned i = 0; i < st->h.ndev && n < FG_MAX_DEV; i++) {
            char node[1100];
            snprintf(node, sizeof(node), "%s/nvidia%u", v, st->cfg[i].minor_number);
            if (access(node, F_OK) == 0)
                map[n++] = (int)i;
        }
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
            for (int u = (int)st->h.ndev; u < FG_MAX_DEV && found < 0; u++)
                if (fg_unit_is_mig(st, u) && !strcmp(st->cfg[u].uuid, tok))
                    found = fg_unit_root(st, u); /* a MIG device: its GPU, as NVML shows it */
        }
        for (int j = 0; j < n && found >= 0; j++)
            if (map[j] == found)
                found = -1;
        if (found >= 0 && n < FG_MAX_DEV)
            map[n++] = found;
    }
    return n;
}

/* A MIG device is usable with access to its GPU and to its GI's and CI's capabilities (MIG user
 * guide, "Device Nodes and Capabilities": "For a CUDA process to be able to run on top of MIG, it
 * needs access to the Compute Instance capability and its parent GPU Instance").  Unset or "all":
 * the host, which (root, CAP_SYS_ADMIN) has every capability.  A path: the GPU's node and
 * `<path>/nvidia-caps/nvidia-cap<minor>` of the GI and the CI, the nodes NVIDIA's toolkit puts
 * into a container for a MIG device.  A list: the MIG device's own UUID (a GPU's UUID or index
 * gives the GPU, not its MIG devices). */
int fg_mig_visible(const struct fg_state *st, int unit)
{
    if (!fg_unit_is_mig(st, unit))
        return 0;
    int gpu = fg_unit_root(st, unit);
    const char *v = fg_env("FAKEGPU_VISIBLE_DEVICES");
    if (!v || !strcmp(v, "all"))
        return 1;
    if (v[0] == '/') {
        char node[1100];
        unsigned minor = st->cfg[gpu].minor_number;
        snprintf(node, sizeof(node), "%s/nvidia%u", v, minor);
        if (access(node, F_OK) != 0)
            return 0;
        snprintf(node, sizeof(node), "%s/nvidia-caps/nvidia-cap%u", v, fg_mig_cap_minor(minor, st->unit[unit].gi, -1));
        if (access(node, F_OK) != 0)
            return 0;
        snprintf(node, sizeof(node), "%s/nvidia-caps/nvidia-cap%u", v,
                 fg_mig_cap_minor(minor, st->unit[unit].gi, (int)st->unit[unit].ci));
        return access(node, F_OK) == 0;
    }
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", v);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
        if (!strcmp(st->cfg[unit].uuid, tok))
            return 1;
    return 0;
}
