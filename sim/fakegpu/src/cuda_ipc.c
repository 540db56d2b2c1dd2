/* fakegpu libcuda: device memory shared between processes, and registered host memory.
 *
 * Written from NVIDIA's CUDA Driver API reference, "Memory Management" (cuIpcGetMemHandle,
 * cuIpcOpenMemHandle, cuIpcCloseMemHandle, cuMemHostRegister, cuMemHostUnregister,
 * cuMemHostGetDevicePointer), "Virtual Memory Management" (cuMemExportToShareableHandle,
 * cuMemImportFromShareableHandle: cuda_vmm.c) and "Stream Ordered Memory Allocator"
 * (cuMemPoolExportToShareableHandle, cuMemPoolImportFromShareableHandle, cuMemPoolExportPointer,
 * cuMemPoolImportPointer: cuda_pool.c).
 *
 * A shared allocation is one entry of the node's table (fg_shared.c): its bytes live in a file,
 * <FAKEGPU_STATE>.mem/<index>.<generation>, mapped MAP_SHARED by every process that holds it, so
 * what one process writes the others read; its device memory counts once (in one holder's
 * mem_device) however many processes map it, and is freed when the last holder lets go (a dead
 * holder lets go too).  The descriptors handed out for POSIX_FILE_DESCRIPTOR exports are
 * descriptors of that file; an import finds the entry by the file's identity.
 *
 * Legacy IPC (what torch.multiprocessing and vLLM use): cuIpcGetMemHandle on the base of a
 * cuMemAlloc allocation moves its bytes into such a file (same address, same contents) and
 * returns a handle naming the entry; the same allocation always gives the same handle.
 * cuIpcOpenMemHandle maps it in another process (in the exporting process:
 * CUDA_ERROR_INVALID_CONTEXT; opened twice: the same pointer, counted); cuIpcCloseMemHandle
 * unmaps.  The exporter's cuMemFree and the importers' closes each drop one holder.
 *
 * Registered host memory (cuMemHostRegister) is host memory: never counted on a device.
 */
#include "fg_cuda.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define IPC_MAGIC 0x3143504947464b46ULL /* "FKGFGIPC1"-ish: a handle made by this driver */

/* CUipcMemHandle: 64 opaque bytes */
struct ipc_handle {
    uint64_t magic;
    int32_t idx;
    int32_t dev;
    uint64_t gen;
    uint64_t size;
    int32_t pid; /* the exporting process */
    uint32_t pad;
    char reserved[24];
};
_Static_assert(sizeof(struct ipc_handle) == 64, "CUipcMemHandle size");

/* --- shared entries and their files --------------------------------------------------- */

static int make_dir(void)
{
    char dir[4200];
    int n = snprintf(dir, sizeof(dir), "%s.mem", fg_state_path());
    if (n <= 0 || (size_t)n >= sizeof(dir))
        return -1;
    if (mkdir(dir, 01777) != 0 && errno != EEXIST)
        return -1;
    struct stat sb; /* the default state lives in /tmp: never a directory someone linked there */
    if (lstat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return -1;
    (void)chmod(dir, 01777); /* processes of other users on the node (containers) share it */
    return 0;
}

int fg_share_new(uint32_t kind, int dev, uint64_t size, uint64_t counted, int *idx, uint64_t *gen, CUresult *rc)
{
    struct fg_state *st = fg_g.st;
    fg_lock();
    int i = fg_shared_new(st, kind, dev, counted, counted ? fg_g.slot : -1, fg_g.slot);
    uint64_t g = i >= 0 ? st->shared[i].generation : 0;
    fg_unlock();
    if (i < 0) {
        *rc = CUDA_ERROR_OUT_OF_MEMORY; /* the node's table of shared allocations is full */
        return -1;
    }
    char path[4200];
    int fd = -1;
    if (make_dir() == 0 && fg_shared_path(i, g, path, sizeof(path)) == 0)
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
    struct stat sb;
    if (fd < 0 || fchmod(fd, 0666) != 0 || ftruncate(fd, (off_t)size) != 0 || fstat(fd, &sb) != 0) {
        if (fd >= 0)
            close(fd);
        fg_lock();
        st->shared[i].bytes = 0; /* the creator keeps its own charge */
        st->shared[i].charged_slot = -1;
        fg_shared_drop(st, i, fg_g.slot, 1);
        fg_unlock();
        *rc = CUDA_ERROR_OUT_OF_MEMORY;
        return -1;
    }
    fg_lock();
    st->shared[i].ino = (uint64_t)sb.st_ino;
    st->shared[i].fsdev = (uint64_t)sb.st_dev;
    fg_unlock();
    *idx = i;
    *gen = g;
    return fd;
}

void fg_share_drop(int idx, uint64_t gen)
{
    struct fg_state *st = fg_g.st;
    fg_lock();
    if (fg_shared_find(st, idx, gen) >= 0)
        fg_shared_drop(st, idx, fg_g.slot, 1);
    fg_unlock();
}

int fg_share_open(int idx, uint64_t gen, uint32_t kind, uint64_t *size, int *dev, CUresult *rc)
{
    struct fg_state *st = fg_g.st;
    fg_lock();
    int i = fg_shared_find(st, idx, gen);
    if (i >= 0 && st->shared[i].kind == kind) {
        fg_shared_hold(st, i, fg_g.slot);
        *dev = st->shared[i].dev;
    } else {
        i = -1;
    }
    fg_unlock();
    if (i < 0) {
        *rc = CUDA_ERROR_INVALID_HANDLE; /* freed by every process that held it */
        return -1;
    }
    char path[4200];
    struct stat sb;
    int fd = fg_shared_path(idx, gen, path, sizeof(path)) == 0 ? open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW) : -1;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        if (fd >= 0)
            close(fd);
        fg_share_drop(idx, gen);
        *rc = CUDA_ERROR_MAP_FAILED;
        return -1;
    }
    *size = (uint64_t)sb.st_size;
    return fd;
}

int fg_share_import_fd(int fd, uint32_t kind, int *idx, uint64_t *gen, uint64_t *size, int *dev)
{
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))
        return -1;
    struct fg_state *st = fg_g.st;
    fg_lock();
    int i = fg_shared_find_file(st, (uint64_t)sb.st_ino, (uint64_t)sb.st_dev);
    if (i >= 0 && st->shared[i].kind == kind) {
        fg_shared_hold(st, i, fg_g.slot);
        *idx = i;
        *gen = st->shared[i].generation;
        *dev = st->shared[i].dev;
    } else {
        i = -1;
    }
    fg_unlock();
    *size = (uint64_t)sb.st_size;
    return i < 0 ? -1 : 0;
}

void *fg_share_map(int fd, uint64_t size, uint64_t at)
{
    void *p = mmap((void *)(uintptr_t)at, size, PROT_READ | PROT_WRITE, MAP_SHARED | (at ? MAP_FIXED : 0), fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* --- legacy IPC -------------------------------------------------------------------------- */

FG_API CUresult cuIpcGetMemHandle(struct ipc_handle *h, CUdeviceptr p)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_alloc a;
    /* the base of a cuMemAlloc allocation */
    if (fg_alloc_find(p, 0, &a) != 0 || a.ptr != p || (a.kind != FG_ALLOC_DEVICE && a.kind != FG_ALLOC_PITCH))
        return CUDA_ERROR_INVALID_VALUE;
    if (!a.shared) {
        int idx;
        uint64_t gen;
        int fd = fg_share_new(FG_SHK_IPC, a.dev, a.size, a.charged, &idx, &gen, &rc);
        if (fd < 0)
            return rc;
        /* same address, same bytes, now in the shared file */
        ssize_t w = pwrite(fd, (const void *)(uintptr_t)a.ptr, a.size, 0);
        void *m = (uint64_t)w == a.size ? fg_share_map(fd, a.size, a.ptr) : NULL;
        close(fd);
        if (!m) {
            fg_lock();
            fg_g.st->shared[idx].bytes = 0; /* the allocation keeps its own charge */
            fg_g.st->shared[idx].charged_slot = -1;
            fg_unlock();
            fg_share_drop(idx, gen);
            return CUDA_ERROR_MAP_FAILED;
        }
        a.shared = idx + 1;
        a.shared_gen = gen;
        fg_alloc_update(&a);
    }
    memset(h, 0, sizeof(*h));
    h->magic = IPC_MAGIC;
    h->idx = a.shared - 1;
    h->dev = a.dev;
    h->gen = a.shared_gen;
    h->size = a.size;
    h->pid = (int32_t)getpid();
    return CUDA_SUCCESS;
}

/* an open of the same handle in this process: its record, 0 or -1 */
static int find_open(int idx, uint64_t gen, struct fg_alloc *out);

FG_API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pp, struct ipc_handle h, unsigned int flags)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (!pp || (flags & ~1u) || h.magic != IPC_MAGIC) /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
        return CUDA_ERROR_INVALID_VALUE;
    if (h.pid == (int32_t)getpid())
        return CUDA_ERROR_INVALID_CONTEXT; /* not in the process that exported it */
    struct fg_alloc a;
    if (find_open(h.idx, h.gen, &a) == 0) {
        a.refs++;
        fg_alloc_update(&a);
        *pp = a.ptr;
        return CUDA_SUCCESS;
    }
    uint64_t size = 0;
    int dev = 0;
    int fd = fg_share_open(h.idx, h.gen, FG_SHK_IPC, &size, &dev, &rc);
    if (fd < 0)
        return rc;
    void *m = fg_share_map(fd, size, 0);
    close(fd);
    a = (struct fg_alloc){.ptr = (uint64_t)(uintptr_t)m, .size = size, .dev = dev, .kind = FG_ALLOC_IMPORT,
                          .shared = h.idx + 1, .shared_gen = h.gen, .refs = 1};
    if (!m || fg_alloc_insert(&a) != 0) {
        if (m)
            munmap(m, size);
        fg_share_drop(h.idx, h.gen);
        return m ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_MAP_FAILED;
    }
    *pp = a.ptr;
    return CUDA_SUCCESS;
}

FG_API CUresult cuIpcOpenMemHandle(CUdeviceptr *pp, struct ipc_handle h, unsigned int flags)
{
    return cuIpcOpenMemHandle_v2(pp, h, flags);
}

FG_API CUresult cuIpcCloseMemHandle(CUdeviceptr p)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    struct fg_alloc a;
    if (fg_alloc_find(p, 0, &a) != 0 || a.ptr != p || a.kind != FG_ALLOC_IMPORT)
        return CUDA_ERROR_INVALID_VALUE;
    if (--a.refs > 0) {
        fg_alloc_update(&a);
        return CUDA_SUCCESS;
    }
    if (fg_alloc_remove(p, &a) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    fg_ipc_free(&a);
    return CUDA_SUCCESS;
}

int fg_ipc_free(const struct fg_alloc *a)
{
    int shared_dev = (a->kind == FG_ALLOC_DEVICE || a->kind == FG_ALLOC_PITCH || a->kind == FG_ALLOC_ASYNC) && a->shared;
    if (!shared_dev && a->kind != FG_ALLOC_IMPORT && a->kind != FG_ALLOC_POOLIMPORT)
        return 0;
    munmap((void *)(uintptr_t)a->ptr, a->size);
    if (a->shared)
        fg_share_drop(a->shared - 1, a->shared_gen); /* the last holder takes the memory with it */
    return 1;
}

/* --- registered host memory -------------------------------------------------------------- */

FG_API CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned int flags)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    /* PORTABLE 1, DEVICEMAP 2, IOMEMORY 4, READ_ONLY 8 */
    if (!p || size == 0 || (flags & ~0xfu))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t ptr = (uint64_t)(uintptr_t)p;
    struct fg_alloc a;
    if (fg_alloc_find(ptr, 1, &a) == 0 || fg_alloc_find(ptr + size - 1, 1, &a) == 0)
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    a = (struct fg_alloc){.ptr = ptr, .size = size, .kind = FG_ALLOC_HOSTREG};
    return fg_alloc_insert(&a) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

FG_API CUresult cuMemHostRegister(void *p, size_t size, unsigned int flags)
{
    return cuMemHostRegister_v2(p, size, flags);
}

FG_API CUresult cuMemHostUnregister(void *p)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    struct fg_alloc a;
    uint64_t ptr = (uint64_t)(uintptr_t)p;
    if (!p || fg_alloc_find(ptr, 0, &a) != 0 || a.ptr != ptr || a.kind != FG_ALLOC_HOSTREG)
        return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    fg_alloc_remove(ptr, &a); /* the caller's memory: nothing to unmap, nothing was counted */
    return CUDA_SUCCESS;
}

/* Host memory that is registered or page-locked is addressed by the device at the same address
 * (unified addressing). */
FG_API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pd, void *p, unsigned int flags)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    struct fg_alloc a;
    if (!pd || !p || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (fg_alloc_find((uint64_t)(uintptr_t)p, 0, &a) != 0 || (a.kind != FG_ALLOC_HOSTREG && a.kind != FG_ALLOC_HOST))
        return CUDA_ERROR_INVALID_VALUE;
    *pd = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

static int find_open(int idx, uint64_t gen, struct fg_alloc *out)
{
    return fg_alloc_find_shared(FG_ALLOC_IMPORT, idx + 1, gen, out);
}
