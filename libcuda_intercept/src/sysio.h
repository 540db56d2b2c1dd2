/* sysio.h — fstat(2) and memfd_create(2) as raw syscalls.  Their glibc
 * wrappers carry symbol versions (2.33, 2.27) newer than what old container
 * images have, and a preload that needs them would not load (see resolve.c). */
#ifndef VGPU_SYSIO_H
#define VGPU_SYSIO_H

#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline int vgpu_fstat(int fd, struct stat *st) { return (int)syscall(SYS_fstat, fd, st); }
static inline int vgpu_memfd(const char *name) { return (int)syscall(SYS_memfd_create, name, MFD_CLOEXEC); }

#endif
