/*
 * Minimal declarations of the CUDA driver API ABI used by libvgpu and the test fakes.
 * No CUDA toolkit is needed: only the handful of types, constants and signatures the
 * shim intercepts are declared here, with the layouts of the public cuda.h.
 */
#ifndef LIBVGPU_CUDA_ABI_H
#define LIBVGPU_CUDA_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUmod_st *CUmodule;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUlib_st *CUlibrary; /* CUDA 12: context-independent loading (cuLibrary*) */
typedef struct CUkern_st *CUkernel;  /* CUDA 12: a library's kernel, context-independent (cuLibraryGetKernel) */

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_FILE_NOT_FOUND 301
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_SUPPORTED 801
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE 910

/* cuGetProcAddress flags */
#define CU_GET_PROC_ADDRESS_DEFAULT 0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM 1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2
typedef int CUdriverProcAddressQueryResult;
#define CU_GET_PROC_ADDRESS_SUCCESS 0
#define CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND 1
#define CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT 2

#define CU_STREAM_CAPTURE_STATUS_NONE 0
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1

#define CU_GRAPH_NODE_TYPE_KERNEL 0
#define CU_GRAPH_NODE_TYPE_MEMCPY 1
#define CU_GRAPH_NODE_TYPE_GRAPH 4 /* a child graph (CUgraphNodeType numbers it 4; 1 is a memcpy node) */
#define CU_GRAPH_NODE_TYPE_MEM_ALLOC 10
#define CU_GRAPH_NODE_TYPE_MEM_FREE 11

/* CUgraphMem_attribute: the device's graph memory pool (bytes, cuuint64_t) */
#define CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT 0
#define CU_GRAPH_MEM_ATTR_USED_MEM_HIGH 1
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH 3

/* CUgraphInstantiate_flags */
#define CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD 2

#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1 /* CUmemAllocationHandleType */

#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR 39
#define CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES 3 /* CUfunction_attribute: local memory per thread (bytes) */
#define CU_LIMIT_STACK_SIZE 0                /* CUlimit: stack size per thread (bytes) */

typedef struct {
    unsigned char bytes[16];
} CUuuid;

/* cuCtxCreate_v3 (CUDA 11.4) and _v4 (CUDA 12.5) arguments */
typedef struct {
    int type; /* CUexecAffinityType */
    union {
        struct {
            unsigned int val;
        } smCount;
    } param;
} CUexecAffinityParam;

typedef struct {
    CUexecAffinityParam *execAffinityParams;
    int numExecAffinityParams;
    void *cigParams;
} CUctxCreateParams;

typedef struct {
    int id;
    union {
        unsigned char pad[64];
    } value;
} CUlaunchAttribute;

typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

/* cuLaunchCooperativeKernelMultiDevice: one entry per device */
typedef struct {
    CUfunction function;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void **kernelParams;
} CUDA_LAUNCH_PARAMS;

typedef struct {
    CUfunction func;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void **kernelParams;
    void **extra;
    /* _v2 adds CUkernel kern; CUcontext ctx; reserve room so either layout fits */
    void *v2_kern;
    void *v2_ctx;
} CUDA_KERNEL_NODE_PARAMS;

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
} CUmemAllocationProp;

typedef struct {
    int allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

typedef struct {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

/* cuGraphAddMemAllocNode / cuGraphMemAllocNodeGetParams */
typedef struct {
    CUmemPoolProps poolProps;
    const CUmemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr; /* out: the allocation's address, fixed across instantiations and launches */
} CUDA_MEM_ALLOC_NODE_PARAMS;

/* cuGraphGetEdges_v2 (CUDA 12.3): an edge's data; all zero for an ordinary dependency (the downstream node starts
 * once the upstream one has completed). A programmatic edge (type CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, or a
 * kernel's programmatic or launch-order out-port) lets it start earlier. */
typedef struct {
    unsigned char from_port;
    unsigned char to_port;
    unsigned char type;
    unsigned char reserved[5];
} CUgraphEdgeData;

/* cuGraphAddNode (the fakes take CU_GRAPH_NODE_TYPE_GRAPH only): a child graph, cloned or moved into the parent */
#define CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE 0
#define CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE 1
typedef struct {
    int type; /* CUgraphNodeType */
    int reserved0[3];
    union {
        long long reserved1[29];
        struct {
            CUgraph graph;
            int ownership; /* CUgraphChildGraphNodeOwnership */
        } graph;
        CUDA_KERNEL_NODE_PARAMS kernel; /* CU_GRAPH_NODE_TYPE_KERNEL (CUDA_KERNEL_NODE_PARAMS_v3: func first) */
    } u;
    long long reserved2;
} CUgraphNodeParams;

/* cuGraphInstantiateWithParams */
typedef struct {
    cuuint64_t flags;
    CUstream hUploadStream;
    CUgraphNode hErrNode_out;
    int result_out; /* CUgraphInstantiateResult */
} CUDA_GRAPH_INSTANTIATE_PARAMS;

/* CUarray_format values (bytes per channel element) */
#define CU_AD_FORMAT_UNSIGNED_INT8 0x01
#define CU_AD_FORMAT_UNSIGNED_INT16 0x02
#define CU_AD_FORMAT_UNSIGNED_INT32 0x03
#define CU_AD_FORMAT_SIGNED_INT8 0x08
#define CU_AD_FORMAT_SIGNED_INT16 0x09
#define CU_AD_FORMAT_SIGNED_INT32 0x0a
#define CU_AD_FORMAT_HALF 0x10
#define CU_AD_FORMAT_FLOAT 0x20

#endif
