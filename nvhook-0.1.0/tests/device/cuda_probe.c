/* A CUDA driver-API probe for tests/device/real_gpu.sh: loads libcuda.so.1 the way an
   application does (dlopen, so it builds without the CUDA headers), then proves the device
   works by writing a pattern into device memory and reading it back. Prints one line. */
#include <dlfcn.h>
#include <stdio.h>

typedef int (*fn_i)(unsigned);
typedef int (*fn_pi)(int *);
typedef int (*fn_dev)(int *, int);
typedef int (*fn_ctx)(void **, int);
typedef int (*fn_alloc)(unsigned long long *, size_t);
typedef int (*fn_set)(unsigned long long, unsigned, size_t);
typedef int (*fn_dtoh)(void *, unsigned long long, size_t);
typedef int (*fn_name)(char *, int, int);

int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("probe: dlopen libcuda.so.1: %s\n", dlerror()); return 2; }
    fn_i cuInit = (fn_i)dlsym(h, "cuInit");
    fn_pi cuDriverGetVersion = (fn_pi)dlsym(h, "cuDriverGetVersion");
    fn_pi cuDeviceGetCount = (fn_pi)dlsym(h, "cuDeviceGetCount");
    fn_dev cuDeviceGet = (fn_dev)dlsym(h, "cuDeviceGet");
    fn_name cuDeviceGetName = (fn_name)dlsym(h, "cuDeviceGetName");
    fn_ctx cuDevicePrimaryCtxRetain = (fn_ctx)dlsym(h, "cuDevicePrimaryCtxRetain");
    int (*cuCtxSetCurrent)(void *) = (int (*)(void *))dlsym(h, "cuCtxSetCurrent");
    fn_alloc cuMemAlloc = (fn_alloc)dlsym(h, "cuMemAlloc_v2");
    fn_set cuMemsetD32 = (fn_set)dlsym(h, "cuMemsetD32_v2");
    fn_dtoh cuMemcpyDtoH = (fn_dtoh)dlsym(h, "cuMemcpyDtoH_v2");
    int ver = -1, n = -1, dev = -1;
    int r = cuInit(0);
    cuDriverGetVersion(&ver);
    if (r) { printf("probe: cuInit=%d driver_api=%d\n", r, ver); return 1; }
    cuDeviceGetCount(&n);
    char name[128] = "";
    cuDeviceGet(&dev, 0);
    cuDeviceGetName(name, sizeof name, dev);
    void *ctx = 0;
    unsigned long long p = 0;
    unsigned out[1024];
    if ((r = cuDevicePrimaryCtxRetain(&ctx, dev)) || (r = cuCtxSetCurrent(ctx)) ||
        (r = cuMemAlloc(&p, sizeof out)) || (r = cuMemsetD32(p, 0x5eed1234u, 1024)) ||
        (r = cuMemcpyDtoH(out, p, sizeof out))) {
        printf("probe: driver_api=%d devices=%d name=%s cuda_error=%d\n", ver, n, name, r);
        return 1;
    }
    int ok = 1;
    for (int i = 0; i < 1024; i++) ok &= out[i] == 0x5eed1234u;
    printf("probe: driver_api=%d devices=%d name=%s memset_readback=%s\n", ver, n, name, ok ? "ok" : "WRONG");
    return ok ? 0 : 1;
}
