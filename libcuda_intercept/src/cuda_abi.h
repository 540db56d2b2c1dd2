/*
 * cuda_abi.h — the few CUDA driver / NVML ABI definitions libvgpu.so needs.
 *
 * Written from the public cuda.h / nvml.h contracts (types, enum values and
 * struct layouts are part of NVIDIA's stable ABI), so the library builds on a
 * machine without the CUDA toolkit.  Only what the hooks read is declared.
 */
#ifndef VGPU_CUDA_ABI_H
#define VGPU_CUDA_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef uint64_t cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUevent_st *CUevent;
typedef struct CUlaunchConfig_st CUlaunchConfig;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
};

/* cuGetProcAddress flags and query results */
#define CU_GET_PROC_ADDRESS_DEFAULT 0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM 1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2
typedef enum {
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
} CUdriverProcAddressQueryResult;

#define CU_MEM_ATTACH_GLOBAL 0x1
#define CU_MEM_ATTACH_HOST 0x2
#define CU_DEVICE_CPU ((CUdevice)-1)
/* CUmem_advise */
#define CU_MEM_ADVISE_SET_READ_MOSTLY 1
#define CU_MEM_ADVISE_UNSET_READ_MOSTLY 2
#define CU_MEM_ADVISE_SET_PREFERRED_LOCATION 3
#define CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION 4
#define CU_MEM_ADVISE_SET_ACCESSED_BY 5
#define CU_MEM_ADVISE_UNSET_ACCESSED_BY 6
/* CUdevice_attribute */
#define CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT 14
#define CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT 51
#define CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS 89
#define CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID 134
#define CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 141
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_STREAM_PER_THREAD ((CUstream)0x2)
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_LOCATION_TYPE_HOST 2
#define CU_MEM_LOCATION_TYPE_HOST_NUMA 3
#define CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT 4
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD 4
#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5
#define CU_MEMPOOL_ATTR_USED_MEM_CURRENT 7
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2
#define CU_GRAPH_NODE_TYPE_MEM_ALLOC 10
#define CU_STREAM_CAPTURE_STATUS_NONE 0
#define CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD 2

typedef struct {
    char bytes[16];
} CUuuid;

typedef struct {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;

typedef struct {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp; /* whole (32 bytes): the host fallback copies it */

typedef struct {
    int allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps; /* 88 bytes */

typedef struct {
    CUmemPoolProps poolProps;
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS; /* _v1, 120 bytes */

typedef struct {
    cuuint64_t flags;
    CUstream hUploadStream;
    CUgraphNode hErrNode_out;
    int result_out;
} CUDA_GRAPH_INSTANTIATE_PARAMS;

typedef struct {
    char reserved[64];
} CUipcMemHandle;

typedef struct {
    size_t Width;
    size_t Height;
    int Format; /* CUarray_format */
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct {
    size_t Width;
    size_t Height;
    size_t Depth;
    int Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

/* NVML */
typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NO_PERMISSION = 4,
};
typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#endif
