/*
 * Red-team driver for the shim's context cost, third round (tests/security/test_redteam_ctxcost3.py):
 * the second round's tenant (ctxcost2_redteam.c, "steps") and a process that releases and retains the
 * primary context in an atexit handler while another thread is inside a context creation (the GPU's
 * creation lock held). Linked against the fake libcuda, run with the shim preloaded.
 *
 *   ctxcost3_redteam steps              see ctxcost2_redteam.c
 *   ctxcost3_redteam atexit DEV GATE    retains the primary context on DEV, registers an atexit handler,
 *                                       starts a thread creating a context on DEV that waits at the fake's
 *                                       gate GATE, says "ready" and waits for a line on stdin; then exits:
 *                                       the handler says "atexit release", releases the primary context
 *                                       (it waits for the creation), says "atexit released rc=R", retains
 *                                       and releases it again and says "atexit done rc=R"
 */
#define main ctxcost2_main
#include "ctxcost2_redteam.c"
#undef main

static int g_atexit_dev;

static void release_at_exit(void)
{
    printf("atexit release\n");
    fflush(stdout);
    CUresult rc = cuDevicePrimaryCtxRelease_v2(g_atexit_dev);
    printf("atexit released rc=%d\n", rc);
    CUcontext c = NULL;
    rc = cuDevicePrimaryCtxRetain(&c, g_atexit_dev);
    if (rc == CUDA_SUCCESS)
        rc = cuDevicePrimaryCtxRelease_v2(g_atexit_dev);
    printf("atexit done rc=%d\n", rc);
    fflush(stdout);
}

static void *create_at_gate(void *arg)
{
    CUcontext c = NULL;
    cuCtxCreate_v2(&c, 0, *(int *)arg);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc >= 4 && !strcmp(argv[1], "atexit")) {
        if (rt_start() != 0)
            return 2;
        g_atexit_dev = atoi(argv[2]);
        CUcontext c = NULL;
        CUresult rc = cuDevicePrimaryCtxRetain(&c, g_atexit_dev);
        if (rc != CUDA_SUCCESS) {
            printf("fail primary rc=%d\n", rc);
            return 2;
        }
        atexit(release_at_exit);
        setenv("FAKE_CUDA_CTX_GATE", argv[3], 1);
        pthread_t th;
        pthread_create(&th, NULL, create_at_gate, &g_atexit_dev);
        printf("ready\n");
        char line[16];
        if (!fgets(line, sizeof line, stdin))
            return 2;
        exit(0); /* the creating thread is still at the gate */
    }
    return ctxcost2_main(argc, argv);
}
