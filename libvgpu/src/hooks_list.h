/* X-macro list, included several times on purpose: no include guard. */
/* X-macro list of the CUDA driver entry points libvgpu intercepts (HOOK) or only calls (REAL).
 * HOOK(name, return type, parameter list, argument list) */
HOOK(cuInit, CUresult, (unsigned int flags), (flags))
HOOK(cuGetProcAddress, CUresult, (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags),
     (symbol, pfn, cudaVersion, flags))
HOOK(cuGetProcAddress_v2, CUresult,
     (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags, CUdriverProcAddressQueryResult *status),
     (symbol, pfn, cudaVersion, flags, status))
HOOK(cuDeviceTotalMem_v2, CUresult, (size_t *bytes, CUdevice dev), (bytes, dev))
HOOK(cuMemGetInfo_v2, CUresult, (size_t *free_b, size_t *total_b), (free_b, total_b))
HOOK(cuCtxCreate, CUresult, (CUcontext *pctx, unsigned int flags, CUdevice dev), (pctx, flags, dev))
HOOK(cuCtxCreate_v2, CUresult, (CUcontext *pctx, unsigned int flags, CUdevice dev), (pctx, flags, dev))
HOOK(cuCtxCreate_v3, CUresult,
     (CUcontext *pctx, CUexecAffinityParam *params, int nparams, unsigned int flags, CUdevice dev),
     (pctx, params, nparams, flags, dev))
HOOK(cuCtxCreate_v4, CUresult, (CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev),
     (pctx, params, flags, dev))
HOOK(cuCtxDestroy, CUresult, (CUcontext ctx), (ctx))
HOOK(cuCtxDestroy_v2, CUresult, (CUcontext ctx), (ctx))
HOOK(cuDevicePrimaryCtxRetain, CUresult, (CUcontext *pctx, CUdevice dev), (pctx, dev))
HOOK(cuDevicePrimaryCtxRelease, CUresult, (CUdevice dev), (dev))
HOOK(cuDevicePrimaryCtxRelease_v2, CUresult, (CUdevice dev), (dev))
HOOK(cuDevicePrimaryCtxReset, CUresult, (CUdevice dev), (dev))
HOOK(cuDevicePrimaryCtxReset_v2, CUresult, (CUdevice dev), (dev))
HOOK(cuMemAlloc_v2, CUresult, (CUdeviceptr *dptr, size_t bytesize), (dptr, bytesize))
HOOK(cuCtxSetLimit, CUresult, (int limit, size_t value), (limit, value))
HOOK(cuMemAllocPitch_v2, CUresult,
     (CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem),
     (dptr, pitch, width, height, elem))
HOOK(cuMemAllocManaged, CUresult, (CUdeviceptr *dptr, size_t bytesize, unsigned int flags), (dptr, bytesize, flags))
HOOK(cuMemAllocAsync, CUresult, (CUdeviceptr *dptr, size_t bytesize, CUstream s), (dptr, bytesize, s))
HOOK(cuMemAllocAsync_ptsz, CUresult, (CUdeviceptr *dptr, size_t bytesize, CUstream s), (dptr, bytesize, s))
HOOK(cuMemAllocFromPoolAsync, CUresult, (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s),
     (dptr, bytesize, pool, s))
HOOK(cuMemAllocFromPoolAsync_ptsz, CUresult, (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s),
     (dptr, bytesize, pool, s))
HOOK(cuMemCreate, CUresult,
     (CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, unsigned long long flags),
     (handle, size, prop, flags))
HOOK(cuArrayCreate_v2, CUresult, (CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *desc), (arr, desc))
HOOK(cuArray3DCreate_v2, CUresult, (CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc), (arr, desc))
HOOK(cuMipmappedArrayCreate, CUresult,
     (CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned int levels), (arr, desc, levels))
HOOK(cuMemFree_v2, CUresult, (CUdeviceptr dptr), (dptr))
HOOK(cuMemFreeAsync, CUresult, (CUdeviceptr dptr, CUstream s), (dptr, s))
HOOK(cuMemFreeAsync_ptsz, CUresult, (CUdeviceptr dptr, CUstream s), (dptr, s))
HOOK(cuMemRelease, CUresult, (CUmemGenericAllocationHandle handle), (handle))
HOOK(cuMemRetainAllocationHandle, CUresult, (CUmemGenericAllocationHandle *handle, void *addr), (handle, addr))
HOOK(cuMemExportToShareableHandle, CUresult,
     (void *shareableHandle, CUmemGenericAllocationHandle handle, int handleType, unsigned long long flags),
     (shareableHandle, handle, handleType, flags))
HOOK(cuMemMap, CUresult,
     (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags),
     (ptr, size, offset, handle, flags))
HOOK(cuMemUnmap, CUresult, (CUdeviceptr ptr, size_t size), (ptr, size))
HOOK(cuArrayDestroy, CUresult, (CUarray arr), (arr))
HOOK(cuMipmappedArrayDestroy, CUresult, (CUmipmappedArray arr), (arr))
HOOK(cuMemPoolCreate, CUresult, (CUmemoryPool *pool, const CUmemPoolProps *props), (pool, props))
HOOK(cuMemPoolDestroy, CUresult, (CUmemoryPool pool), (pool))
HOOK(cuMemPoolTrimTo, CUresult, (CUmemoryPool pool, size_t keep), (pool, keep))
HOOK(cuLaunchKernel, CUresult,
     (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
      unsigned int bz, unsigned int shmem, CUstream s, void **params, void **extra),
     (f, gx, gy, gz, bx, by, bz, shmem, s, params, extra))
HOOK(cuLaunchKernel_ptsz, CUresult,
     (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
      unsigned int bz, unsigned int shmem, CUstream s, void **params, void **extra),
     (f, gx, gy, gz, bx, by, bz, shmem, s, params, extra))
HOOK(cuLaunchKernelEx, CUresult, (const CUlaunchConfig *config, CUfunction f, void **params, void **extra),
     (config, f, params, extra))
HOOK(cuLaunchKernelEx_ptsz, CUresult, (const CUlaunchConfig *config, CUfunction f, void **params, void **extra),
     (config, f, params, extra))
HOOK(cuLaunchCooperativeKernel, CUresult,
     (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
      unsigned int bz, unsigned int shmem, CUstream s, void **params),
     (f, gx, gy, gz, bx, by, bz, shmem, s, params))
HOOK(cuLaunchCooperativeKernel_ptsz, CUresult,
     (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
      unsigned int bz, unsigned int shmem, CUstream s, void **params),
     (f, gx, gy, gz, bx, by, bz, shmem, s, params))
HOOK(cuLaunchCooperativeKernelMultiDevice, CUresult, (CUDA_LAUNCH_PARAMS *list, unsigned int n, unsigned int flags),
     (list, n, flags))
HOOK(cuLaunch, CUresult, (CUfunction f), (f))
HOOK(cuLaunchGrid, CUresult, (CUfunction f, int w, int h), (f, w, h))
HOOK(cuLaunchGridAsync, CUresult, (CUfunction f, int w, int h, CUstream s), (f, w, h, s))
HOOK(cuGraphInstantiateWithFlags, CUresult, (CUgraphExec *exec, CUgraph graph, unsigned long long flags),
     (exec, graph, flags))
HOOK(cuGraphInstantiate_v2, CUresult,
     (CUgraphExec *exec, CUgraph graph, CUgraphNode *err, char *log, size_t logsz), (exec, graph, err, log, logsz))
HOOK(cuGraphExecDestroy, CUresult, (CUgraphExec exec), (exec))
HOOK(cuGraphLaunch, CUresult, (CUgraphExec exec, CUstream s), (exec, s))
HOOK(cuGraphLaunch_ptsz, CUresult, (CUgraphExec exec, CUstream s), (exec, s))
HOOK(cuGraphInstantiate, CUresult,
     (CUgraphExec *exec, CUgraph graph, CUgraphNode *err, char *log, size_t logsz), (exec, graph, err, log, logsz))
HOOK(cuGraphInstantiateWithParams, CUresult, (CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params),
     (exec, graph, params))
HOOK(cuGraphInstantiateWithParams_ptsz, CUresult,
     (CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params), (exec, graph, params))
HOOK(cuGraphUpload, CUresult, (CUgraphExec exec, CUstream s), (exec, s))
HOOK(cuGraphUpload_ptsz, CUresult, (CUgraphExec exec, CUstream s), (exec, s))
HOOK(cuGraphExecUpdate, CUresult, (CUgraphExec exec, CUgraph graph, CUgraphNode *err, int *result),
     (exec, graph, err, result))
HOOK(cuGraphExecUpdate_v2, CUresult, (CUgraphExec exec, CUgraph graph, void *info), (exec, graph, info))
HOOK(cuGraphExecKernelNodeSetParams, CUresult, (CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p),
     (exec, node, p))
HOOK(cuGraphExecKernelNodeSetParams_v2, CUresult, (CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p),
     (exec, node, p))
HOOK(cuGraphExecNodeSetParams, CUresult, (CUgraphExec exec, CUgraphNode node, CUgraphNodeParams *p), (exec, node, p))
HOOK(cuDeviceGraphMemTrim, CUresult, (CUdevice dev), (dev))
HOOK(cuModuleLoad, CUresult, (CUmodule *m, const char *fname), (m, fname))
HOOK(cuModuleLoadData, CUresult, (CUmodule *m, const void *image), (m, image))
HOOK(cuModuleLoadDataEx, CUresult, (CUmodule *m, const void *image, unsigned int n, int *opts, void **vals),
     (m, image, n, opts, vals))
HOOK(cuModuleLoadFatBinary, CUresult, (CUmodule *m, const void *fatbin), (m, fatbin))
HOOK(cuModuleUnload, CUresult, (CUmodule m), (m))
HOOK(cuLibraryLoadData, CUresult,
     (CUlibrary *lib, const void *code, int *jitOptions, void **jitValues, unsigned int nJit, int *libOptions,
      void **libValues, unsigned int nLib),
     (lib, code, jitOptions, jitValues, nJit, libOptions, libValues, nLib))
HOOK(cuLibraryLoadFromFile, CUresult,
     (CUlibrary *lib, const char *fileName, int *jitOptions, void **jitValues, unsigned int nJit, int *libOptions,
      void **libValues, unsigned int nLib),
     (lib, fileName, jitOptions, jitValues, nJit, libOptions, libValues, nLib))
HOOK(cuLibraryUnload, CUresult, (CUlibrary lib), (lib))

/* called, never intercepted */
REAL(cuCtxGetCurrent, CUresult, (CUcontext *pctx))
REAL(cuLibraryGetModule, CUresult, (CUmodule *m, CUlibrary lib))
REAL(cuCtxPushCurrent_v2, CUresult, (CUcontext ctx))
REAL(cuCtxPopCurrent_v2, CUresult, (CUcontext *pctx))
REAL(cuCtxGetDevice, CUresult, (CUdevice *dev))
REAL(cuDeviceGetAttribute, CUresult, (int *pi, int attrib, CUdevice dev))
REAL(cuDeviceGetCount, CUresult, (int *count))
REAL(cuDeviceGetUuid, CUresult, (CUuuid *uuid, CUdevice dev))
REAL(cuStreamIsCapturing, CUresult, (CUstream s, int *status))
REAL(cuDeviceGetMemPool, CUresult, (CUmemoryPool *pool, CUdevice dev))
REAL(cuMemPoolGetAttribute, CUresult, (CUmemoryPool pool, int attr, void *value))
REAL(cuGraphGetNodes, CUresult, (CUgraph graph, CUgraphNode *nodes, size_t *count))
REAL(cuGraphNodeGetType, CUresult, (CUgraphNode node, int *type))
REAL(cuGraphKernelNodeGetParams, CUresult, (CUgraphNode node, CUDA_KERNEL_NODE_PARAMS *params))
REAL(cuGraphMemAllocNodeGetParams, CUresult, (CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *params))
REAL(cuGraphChildGraphNodeGetGraph, CUresult, (CUgraphNode node, CUgraph *graph))
REAL(cuGraphMemFreeNodeGetParams, CUresult, (CUgraphNode node, CUdeviceptr *dptr))
REAL(cuGraphGetEdges, CUresult, (CUgraph graph, CUgraphNode *from, CUgraphNode *to, size_t *num))
REAL(cuGraphGetEdges_v2, CUresult,
     (CUgraph graph, CUgraphNode *from, CUgraphNode *to, CUgraphEdgeData *data, size_t *num))
REAL(cuDeviceGetGraphMemAttribute, CUresult, (CUdevice dev, int attr, void *value))
REAL(cuFuncGetAttribute, CUresult, (int *pi, int attrib, CUfunction f))
REAL(cuKernelGetAttribute, CUresult, (int *pi, int attrib, CUkernel kernel, CUdevice dev))
REAL(cuStreamGetCtx, CUresult, (CUstream s, CUcontext *pctx))
