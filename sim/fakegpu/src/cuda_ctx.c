/* fakegpu libcuda: contexts (primary and created), the per-thread current-context stack. */
#include "fg_cuda.h"

#include <string.h>

#define STACK_MAX 16
static __thread struct fg_ctx *tls_stack[STACK_MAX];
static __thread int tls_depth;

int fg_ctx_valid(const struct fg_ctx *c)
{
    return c && c >= &fg_drv.ctxs[0] && c < &fg_drv.ctxs[FG_MAX_CTX] && c->magic == FG_MAGIC_CTX;
}

struct fg_ctx *fg_current(CUresult *err)
{
    CUresult rc = fg_check_init();
    if (rc) {
        *err = rc;
        return NULL;
    }
    struct fg_ctx *c = tls_depth > 0 ? tls_stack[tls_depth - 1] : NULL;
    if (!fg_ctx_valid(c)) {
        *err = CUDA_ERROR_INVALID_CONTEXT;
        return NULL;
    }
    if (!c->active) {
        *err = CUDA_ERROR_CONTEXT_IS_DESTROYED; /* a released primary context */
        return NULL;
    }
    if (fg_dev_lost(c->dev)) {
        *err = CUDA_ERROR_DEVICE_UNAVAILABLE;
        return NULL;
    }
    *err = CUDA_SUCCESS;
    return c;
}

static struct fg_ctx *ctx_new(int dev, int primary, unsigned flags)
{
    for (int i = 0; i < FG_MAX_CTX; i++) {
        if (fg_drv.ctxs[i].magic == 0) {
            struct fg_ctx *c = &fg_drv.ctxs[i];
            c->magic = FG_MAGIC_CTX;
            c->dev = dev;
            c->primary = primary;
            c->flags = flags;
            c->active = 1;
            static unsigned long long next_id;
            c->id = ++next_id;
            return c;
        }
    }
    return NULL;
}

/* Tears a context down: waits for its device work, frees its allocations, uncharges it.  A
 * primary context's handle stays valid (inactive): the runtime keeps it (CUDART_INTERFACE[2]) and
 * retaining the primary context again gives the same handle. */
static void ctx_teardown(struct fg_ctx *c)
{
    fg_wait_idle(c->dev, -1);
    fg_alloc_free_ctx(c);
    fg_ctx_charge(c->dev, -1);
    c->active = 0;
    if (c->primary)
        return;
    for (int i = 0; i < tls_depth; i++)
        if (tls_stack[i] == c)
            tls_stack[i] = NULL;
    c->magic = 0;
}

static CUresult ctx_create(CUcontext *pctx, unsigned flags, CUdevice dev)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    int p = fg_phys(dev);
    if (fg_dev_lost(p))
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    pthread_mutex_lock(&fg_drv.mu);
    rc = fg_ctx_charge(p, +1);
    struct fg_ctx *c = NULL;
    if (rc == CUDA_SUCCESS) {
        c = ctx_new(p, 0, flags);
        if (!c) {
            fg_ctx_charge(p, -1);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    pthread_mutex_unlock(&fg_drv.mu);
    if (rc)
        return rc;
    if (tls_depth >= STACK_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    tls_stack[tls_depth++] = c;
    *pctx = c;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return ctx_create(pctx, flags, dev);
}

/* _v3: (ctx, CUexecAffinityParam *params, int numParams, flags, dev) */
FG_API CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int nparams, unsigned int flags, CUdevice dev)
{
    if (nparams < 0 || (nparams > 0 && !params))
        return CUDA_ERROR_INVALID_VALUE;
    return ctx_create(pctx, flags, dev);
}

/* _v4: (ctx, CUctxCreateParams *params, flags, dev); params may be NULL */
FG_API CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned int flags, CUdevice dev)
{
    (void)params;
    return ctx_create(pctx, flags, dev);
}

FG_API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!fg_ctx_valid(ctx) || ctx->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    fg_cls_ctx_destroyed(ctx);
    pthread_mutex_lock(&fg_drv.mu);
    if (!fg_ctx_valid(ctx) || ctx->primary) {
        pthread_mutex_unlock(&fg_drv.mu);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    ctx_teardown(ctx);
    pthread_mutex_unlock(&fg_drv.mu);
    /* pop it if it is this thread's current context */
    while (tls_depth > 0 && tls_stack[tls_depth - 1] == NULL)
        tls_depth--;
    return CUDA_SUCCESS;
}

/* The primary context's handle of physical device p, made (inactive, uncharged) if needed; under mu. */
static struct fg_ctx *primary_handle(int p)
{
    if (fg_drv.primary_idx[p] >= 0)
        return &fg_drv.ctxs[fg_drv.primary_idx[p]];
    struct fg_ctx *c = ctx_new(p, 1, fg_drv.primary_flags[p]);
    if (!c)
        return NULL;
    c->active = 0;
    fg_drv.primary_idx[p] = (int)(c - fg_drv.ctxs);
    return c;
}

CUresult fg_primary_ctx_handle(CUcontext *pctx, CUdevice dev)
{
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    int p = fg_phys(dev);
    pthread_mutex_lock(&fg_drv.mu);
    struct fg_ctx *c = primary_handle(p);
    pthread_mutex_unlock(&fg_drv.mu);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pctx = c;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    int p = fg_phys(dev);
    if (fg_dev_lost(p))
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    pthread_mutex_lock(&fg_drv.mu);
    struct fg_ctx *c = primary_handle(p);
    if (!c)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else if (fg_drv.primary_refs[p] == 0) {
        rc = fg_ctx_charge(p, +1);
        if (rc == CUDA_SUCCESS) {
            c->active = 1;
            c->flags = fg_drv.primary_flags[p];
        }
    }
    if (rc == CUDA_SUCCESS) {
        fg_drv.primary_refs[p]++;
        *pctx = c;
    }
    pthread_mutex_unlock(&fg_drv.mu);
    return rc;
}

static CUresult primary_release(CUdevice dev, int reset)
{
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    int p = fg_phys(dev);
    pthread_mutex_lock(&fg_drv.mu);
    if (fg_drv.primary_refs[p] == 0 || fg_drv.primary_idx[p] < 0) {
        pthread_mutex_unlock(&fg_drv.mu);
        return reset ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    }
    struct fg_ctx *c = &fg_drv.ctxs[fg_drv.primary_idx[p]];
    int last = reset || fg_drv.primary_refs[p] == 1;
    pthread_mutex_unlock(&fg_drv.mu);
    if (last)
        fg_cls_ctx_destroyed(c); /* the runtime's destructors, outside the driver's lock */
    pthread_mutex_lock(&fg_drv.mu);
    if (fg_drv.primary_refs[p] > 0) {
        if (reset)
            fg_drv.primary_refs[p] = 0;
        else
            fg_drv.primary_refs[p]--;
        if (fg_drv.primary_refs[p] == 0)
            ctx_teardown(c);
    }
    pthread_mutex_unlock(&fg_drv.mu);
    return CUDA_SUCCESS;
}

FG_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    return primary_release(dev, 0);
}

FG_API CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return primary_release(dev, 0);
}

FG_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    return primary_release(dev, 1);
}

FG_API CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    return primary_release(dev, 1);
}

FG_API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    int p = fg_phys(dev);
    *flags = fg_drv.primary_flags[p];
    *active = fg_drv.primary_refs[p] > 0;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    fg_drv.primary_flags[fg_phys(dev)] = flags;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (ctx && !fg_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!ctx) {
        if (tls_depth > 0)
            tls_depth--;
        return CUDA_SUCCESS;
    }
    if (tls_depth == 0)
        tls_depth = 1;
    tls_stack[tls_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_ctx *c = tls_depth > 0 ? tls_stack[tls_depth - 1] : NULL;
    *pctx = fg_ctx_valid(c) ? c : NULL;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!fg_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_depth >= STACK_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    tls_stack[tls_depth++] = ctx;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (tls_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct fg_ctx *c = tls_stack[--tls_depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxGetDevice(CUdevice *dev)
{
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    *dev = fg_ordinal_of(c->dev);
    return CUDA_SUCCESS;
}

/* CUDA 13: cuCtxGetDevice_v2(CUdevice *, CUcontext ctx); NULL ctx = current */
FG_API CUresult cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx)
{
    if (!ctx)
        return cuCtxGetDevice(dev);
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    if (!fg_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    *dev = fg_ordinal_of(ctx->dev);
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxSynchronize(void)
{
    CUresult rc;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    if ((rc = fg_capture_forbid_ctx()))
        return rc;
    rc = fg_wait_idle(c->dev, -1);
    fg_pools_sync(c->dev);
    return rc;
}

/* CUDA 13: cuCtxSynchronize_v2(CUcontext ctx); NULL = current */
FG_API CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    if (!ctx)
        return cuCtxSynchronize();
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!fg_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if ((rc = fg_capture_forbid_ctx()))
        return rc;
    rc = fg_wait_idle(ctx->dev, -1);
    fg_pools_sync(ctx->dev);
    return rc;
}

FG_API CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    if (ctx && !fg_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    *version = 3020;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxGetFlags(unsigned int *flags)
{
    CUresult rc;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (least)
        *least = 0;
    if (greatest)
        *greatest = -5;
    return CUDA_SUCCESS;
}

CUresult fg_ctx_id(CUcontext ctx, unsigned long long *id)
{
    CUresult rc;
    if (!ctx) {
        if (!(ctx = fg_current(&rc)))
            return rc;
    } else if ((rc = fg_check_init())) {
        return rc;
    } else if (!fg_ctx_valid(ctx)) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    *id = ctx->id;
    return CUDA_SUCCESS;
}

/* CUDA 12.0 */
FG_API CUresult cuCtxGetId(CUcontext ctx, unsigned long long *id)
{
    if (!id)
        return CUDA_ERROR_INVALID_VALUE;
    return fg_ctx_id(ctx, id);
}
