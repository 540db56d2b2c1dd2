/* link_cutest — cutest linked with -lcuda: adds the modes "link" (direct
 * calls through the PLT) and "gpa-linked" (the linked cuGetProcAddress_v2).
 * References are weak so a driver lacking one function still loads. */
#include "common.h"

#define WEAK_DECL(name, base, ver, flags, params) extern CUresult name params __attribute__((weak));
API_FUNCS(WEAK_DECL)
extern CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *)
    __attribute__((weak));

int load_gpa(CUresult (*first)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *));

static int link_load(const char *mode)
{
    if (__builtin_strcmp(mode, "link") == 0) {
#define WEAK_SET(name, base, ver, flags, params) A.name = name;
        API_FUNCS(WEAK_SET)
        return 0;
    }
    if (__builtin_strcmp(mode, "gpa-linked") == 0) {
        if (!cuGetProcAddress_v2)
            die("cuGetProcAddress_v2 not linked");
        return load_gpa(cuGetProcAddress_v2);
    }
    return -1;
}

__attribute__((constructor)) static void reg(void) { link_hook = link_load; }

#define main cutest_main
#include "cutest.c"
#undef main
int main(int argc, char **argv) { return cutest_main(argc, argv); }
