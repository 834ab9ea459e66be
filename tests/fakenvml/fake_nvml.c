/*
 * A fake libnvidia-ml.so.1 for gpuguard's tests.
 *
 * Built into a directory placed first on LD_LIBRARY_PATH, it is what the
 * real, unmodified pynvml loads, so the code under test goes through the
 * same ctypes calls, struct layouts, two-call buffer protocols and error
 * codes it meets on a machine with NVIDIA GPUs.  Nothing here talks to
 * hardware: the GPUs and the processes holding them are described by a text
 * file (path in $FAKE_NVML_STATE, default /run/fake-nvml/state) that is
 * re-read on every call, so a test can change the world between any two
 * calls of a running daemon.  $FAKE_NVML_CALLS names a file that gets a
 * line per call naming a GPU (count_call).
 *
 * State file, one record per line, '#' starts a comment:
 *
 *   driver 550.54.15
 *   init_error 9
 *   fail nvmlDeviceGetComputeRunningProcesses_v3 999
 *   hang nvmlDeviceGetMemoryInfo_v2 60000 [GPU]
 *   gpu 0 uuid=GPU-... name=NVIDIA_H100_80GB_HBM3 minor=0 pci=00000000:17:00.0 total=85899345920 used=0 [lost] [handle_error=15]
 *   proc 0 12345 4294967296 compute release_delay_ms=0 [listed_ms=N] [host_pid=H]
 *        [release_ms=N] [wobble=BYTES wobble_ms=N]
 *   gpu 1 uuid=GPU-... name=... pci=... total=85899345920 mig=on mig_parent_lists=empty
 *   mig 1 0 uuid=MIG-... gi=1 ci=0 total=10737418240 used=0
 *   proc 1 23456 1073741824 compute mig=0
 *
 * gpu records must be numbered 0, 1, 2... in order and come before the
 * procs that name them; '_' in a name stands for a space; minor defaults to
 * the index and used (memory held with no process to show for it) to 0.
 * reserved= is the driver's own reservation: nvmlDeviceGetMemoryInfo_v2
 * reports it apart, the v1 call adds it to "used" (an idle H200 reads 1 MiB
 * used and ~700 MiB reserved through v2, ~701 MiB used through v1).
 * proc records give the gpu index, pid, bytes used and one of compute /
 * graphics / mps; a trailing "raw" lists the pid as written, any 32-bit
 * value, with no liveness check: the garbage real drivers hand out.
 * host_pid=H is the foreign-PID mode: NVML reports the pid the driver
 * recorded, the process's pid in the host's PID namespace, whatever
 * namespace the caller is in; for a caller in a container (its own PID
 * namespace and /proc) that pid names nothing, or someone else.  The
 * record's pid is the process as the caller sees it, which liveness follows;
 * the lists show H.  A process on several lists of one GPU (or instance) is
 * one process with one amount of memory: a driver reports the same figure
 * in each list and counts it once in the memory used, and so does this
 * library (the largest of its records').
 * "node PATH" lines name device nodes the library opens at nvmlInit and
 * keeps open until the last nvmlShutdown, as libnvidia-ml holds
 * /dev/nvidiactl and every /dev/nvidiaN: the caller is a holder too.
 * Anything else is rejected with a message on stderr.
 *
 * Built with -DFAKE_NVML_R535_EARLY it is the ABI of drivers 535.43-535.86:
 * the _v3 process lists write 32-byte entries (with the confidential
 * computing field) where pynvml reads 24, so from the third entry on pynvml
 * decodes pids 0 and 4294967295, and nvmlDeviceGetRunningProcessDetailList
 * does not exist; nvmlDeviceGetConfComputeMemSizeInfo does, as on those
 * drivers (the symbols are how a caller tells them apart).
 *
 * MIG (see the block before the MIG entry points for what real drivers do
 * and where that comes from): a gpu with mig=on is in MIG mode and mig=off
 * is MIG-capable with the mode off; without the key the GPU cannot do MIG
 * at all (NVML_ERROR_NOT_SUPPORTED).  mig records name the parent GPU, the
 * slot nvmlDeviceGetMigDeviceHandleByIndex finds the instance at (slots may
 * have gaps, 0-6), its UUID, GPU and compute instance ids and its memory.
 * A proc with mig=SLOT runs in that instance.  mig_parent_lists= says what
 * the parent's process lists show in MIG mode: "empty" (the default: an
 * unprivileged caller, or a driver that only lists per instance) or
 * "aggregate" (every instance's processes, as nvml.h promises a privileged
 * caller).
 *
 * Liveness: a proc whose pid has exited keeps holding its memory (and stays
 * listed) until release_delay_ms after this library first noticed it was
 * gone, because real drivers tear contexts down asynchronously and gpuguard
 * must cope with memory that lingers after a kill.  listed_ms, when given,
 * is how long of that delay it stays listed: real drivers drop a process
 * from their lists while its memory is still held (sglang issue 31871:
 * memory held over 30 s with no process left).  release_ms, when given,
 * makes the memory come back over time rather than at once: after the delay
 * it falls linearly to nothing over release_ms (a context torn down in
 * pieces).  wobble=BYTES with wobble_ms then makes it grow back: BYTES are
 * in use again for wobble_ms before it settles at nothing (what a start gate
 * must not mistake for free: vLLM issue 56830).  $FAKE_NVML_EVENTS, when
 * set, names a file that gets "dead PID NS" (CLOCK_MONOTONIC) the moment
 * this library first finds a pid gone: the fake's own clock, from which the
 * benchmarks know when memory was really back.  Zombies count as alive:
 * kill(pid, 0) reports them as existing, so that is what a caller probing
 * the pid sees too, and it gives tests a listed pid that no signal removes
 * until its parent reaps it.
 *
 * Faults of real drivers: "hang FUNCTION MS" makes every call of FUNCTION
 * block for MS milliseconds, holding the library's lock as a stuck ioctl
 * holds the driver's, so every other call from that process waits too
 * (open-gpu-kernel-modules issue 1333); with a GPU index, only calls for that
 * GPU hang.  handle_error=CODE makes nvmlDeviceGetHandleByIndex fail for that
 * GPU with CODE (GPU_IS_LOST 15, UNKNOWN 999, NO_PERMISSION 4), as
 * dcgm-exporter issue 604 saw; lost still enumerates and fails every query.
 *
 * The layouts below must match pynvml.py (nvidia-ml-py 13.x) byte for byte;
 * each one names the pynvml class it mirrors.
 */

#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#ifndef O_PATH
#define O_PATH 010000000 /* Linux; hidden by _POSIX_C_SOURCE */
#endif

typedef enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

/* c_nvmlMemory_t */
typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

/* c_nvmlMemory_v2_t */
typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

/* Same formula as NVML_STRUCT_VERSION(Memory, 2); pynvml hardcodes the
 * result, 0x02000028, so the size check below keeps the two in step. */
#define NVML_MEMORY_V2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
typedef char memory_v2_is_40_bytes[sizeof(nvmlMemory_v2_t) == 40 ? 1 : -1];

/* Layout the unversioned process-list entry points have in the real ABI.
 * pynvml never calls them (its unversioned wrappers forward to _v3), but C
 * callers linked against an old nvml.h do. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* c_nvmlProcessInfo_v2_t, which pynvml also uses for _v3 */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* What drivers 535.43-535.86 write through the _v3 process lists (nvitop
 * issues 75 and 88): 32 bytes an entry, the layout that later became
 * nvmlProcessDetail_v1_t. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
    unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;
typedef char process_detail_is_32_bytes[sizeof(nvmlProcessDetail_v1_t) == 32 ? 1 : -1];

/* c_nvmlProcessDetailList_v1_t; pynvml's nvmlProcessDetailList_v1 is
 * 0x1000018, the same NVML_STRUCT_VERSION formula as the memory struct. */
typedef struct {
    unsigned int version;
    unsigned int mode;
    unsigned int numProcArrayEntries;
    nvmlProcessDetail_v1_t *procArray;
} nvmlProcessDetailList_v1_t;
#define NVML_PROCESS_DETAIL_LIST_V1 ((unsigned int)(sizeof(nvmlProcessDetailList_v1_t) | (1u << 24)))
typedef char detail_list_is_24_bytes[sizeof(nvmlProcessDetailList_v1_t) == 24 ? 1 : -1];

/* nvmlPciInfo_v2_t: the layout of nvmlDeviceGetPciInfo and _v2.  It is 16
 * bytes shorter than the v3 struct, so the aliases must not share a writer
 * with _v3 or they would overrun a legacy caller's buffer. */
typedef struct {
    char busId[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int reserved0;
    unsigned int reserved1;
    unsigned int reserved2;
    unsigned int reserved3;
} nvmlPciInfo_v2_t;

/* nvmlPciInfo_t */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

#define MAX_GPUS 64
#define MAX_PROCS 4096
#define MAX_MIGS (MAX_GPUS * MIG_SLOTS)
#define MAX_FAILS 256
#define MAX_HANGS 64
/* NVML_DEVICE_UUID_V2_BUFFER_SIZE and NVML_DEVICE_NAME_V2_BUFFER_SIZE: what
 * pynvml allocates, so anything longer could never be returned anyway. */
#define UUID_SIZE 96
#define NAME_SIZE 96
#define DRIVER_SIZE 80 /* NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE */
#define FUNC_NAME_SIZE 128
#define MAX_LINE 1024
#define DELIMS " \t\r\n"
/* NVIDIA's PCI vendor id with no device id: tests have no use for a
 * particular board's id, and a made-up one would look authoritative. */
#define FAKE_PCI_DEVICE_ID 0x000010DEu
#define DEFAULT_STATE_PATH "/run/fake-nvml/state"
#ifdef FAKE_NVML_R535_EARLY
#define DEFAULT_DRIVER "535.54.03"
#else
#define DEFAULT_DRIVER "550.54.15"
#endif
#define MAX_NODES 64
#define NODE_PATH_SIZE 512

typedef enum { KIND_COMPUTE, KIND_GRAPHICS, KIND_MPS } proc_kind;

struct fake_gpu {
    char uuid[UUID_SIZE];
    char name[NAME_SIZE];
    unsigned int minor;
    unsigned int pci_domain;
    unsigned int pci_bus;
    unsigned int pci_device;
    unsigned int pci_function;
    unsigned long long total;
    unsigned long long base_used;
    unsigned long long reserved;
    int lost;
    nvmlReturn_t handle_error;
    int mig_mode;          /* MIG_UNSUPPORTED, or NVML_DEVICE_MIG_DISABLE/_ENABLE */
    int parent_aggregate;  /* in MIG mode, the parent's lists show every instance's procs */
    int persistence;       /* persistence=on|off; STATE.persistence.N overrides (Set...) */
    int nvlinks;           /* nvlink=N active links; -1: no NVLink (NOT_SUPPORTED) */
};

#define MIG_UNSUPPORTED (-1)
#define NVLINK_MAX_LINKS 18 /* NVML_NVLINK_MAX_LINKS */
#define MIG_DISABLE 0 /* NVML_DEVICE_MIG_DISABLE */
#define MIG_ENABLE 1  /* NVML_DEVICE_MIG_ENABLE */
/* nvmlDeviceGetMaxMigDeviceCount on A100, H100 and H200: at most seven
 * instances (1g profiles), so slots run 0-6. */
#define MIG_SLOTS 7
#define NO_MIG 0xFFFFFFFFu /* a proc outside any instance; NVML's "not MIG" id */

/* One MIG device (a compute instance inside a GPU instance).  Its handle is
 * a pointer into state.migs, as GPU handles point into state.gpus. */
struct fake_mig {
    unsigned int gpu;
    unsigned int slot;
    char uuid[UUID_SIZE];
    unsigned int gi;
    unsigned int ci;
    unsigned long long total;
    unsigned long long base_used;
};

/* pynvml only ever holds a pointer to it, so the handle type can be the
 * device record itself; a handle is a slot in state.gpus and so names
 * whichever GPU the current state file lists at that index. */
typedef struct fake_gpu *nvmlDevice_t;

struct fake_proc {
    unsigned int gpu;
    pid_t pid;
    unsigned long long used;
    proc_kind kind;
    unsigned long long release_delay_ms;
    unsigned long long listed_ms; /* ULLONG_MAX: listed for the whole release delay */
    unsigned long long release_ms; /* after the delay: memory falls to 0 over this long */
    unsigned long long wobble, wobble_ms; /* then: wobble bytes again for wobble_ms */
    int raw; /* listed as written, never checked for liveness */
    unsigned int raw_pid;
    unsigned int host_pid; /* 0: the lists show pid; else what they show (host_pid=) */
    unsigned int mig_slot; /* NO_MIG, or the slot of the instance it runs in */
};

struct fail_rule {
    char function[FUNC_NAME_SIZE];
    nvmlReturn_t code;
};

struct hang_rule {
    char function[FUNC_NAME_SIZE];
    unsigned long long ms;
    int gpu; /* -1: every call of the function */
};

struct state {
    char driver[DRIVER_SIZE];
    nvmlReturn_t init_error;
    struct fail_rule fails[MAX_FAILS];
    unsigned int fail_count;
    struct hang_rule hangs[MAX_HANGS];
    unsigned int hang_count;
    struct fake_gpu gpus[MAX_GPUS];
    unsigned int gpu_count;
    struct fake_proc procs[MAX_PROCS];
    unsigned int proc_count;
    char nodes[MAX_NODES][NODE_PATH_SIZE];
    unsigned int node_count;
    struct fake_mig migs[MAX_MIGS];
    unsigned int mig_count;
};

struct dead_pid {
    pid_t pid;
    unsigned long long first_seen_dead_ns;
};

/* One lock for everything: calls are cheap, and it makes each call see one
 * consistent snapshot of the file even when the daemon polls from several
 * threads. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int g_init_count;
/* Handles point into g_state.gpus, so a reload must never move it: parse
 * into g_scratch and copy over only once the whole file is known good. */
static struct state g_state;
static struct state g_scratch;
/* Outlives reloads and shutdown: it models the driver's view of exited
 * processes, which does not reset when a client re-reads anything. */
static struct dead_pid g_dead[MAX_PROCS];
static unsigned int g_dead_count;
/* The device nodes opened at nvmlInit (the "node" records then), closed at
 * the last nvmlShutdown. */
static int g_node_fds[MAX_NODES];
static unsigned int g_node_fd_count;

static unsigned long long monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

/* ---- state file parsing ---------------------------------------------- */

struct parse_ctx {
    const char *path;
    unsigned int line;
};

static void parse_error(const struct parse_ctx *ctx, const char *what, const char *token)
{
    /* Repeated on every failed load, which is noisy on purpose: a broken
     * state file is a bug in the test, and stderr is where its author will
     * look first. */
    fprintf(stderr, "fake_nvml: %s:%u: %s%s%s%s\n", ctx->path, ctx->line, what,
            token ? " '" : "", token ? token : "", token ? "'" : "");
}

static int parse_ull(const char *s, unsigned long long *out)
{
    char *end;
    unsigned long long v;
    /* strtoull would silently wrap a leading '-' into a huge value. */
    if (s == NULL || *s < '0' || *s > '9')
        return 0;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0')
        return 0;
    *out = v;
    return 1;
}

static int parse_code(const char *s, nvmlReturn_t *out)
{
    unsigned long long v;
    if (!parse_ull(s, &v) || v > INT_MAX)
        return 0;
    *out = (nvmlReturn_t)v;
    return 1;
}

static unsigned int parse_hex_field(const char **p, unsigned int max_digits, int *ok)
{
    unsigned long v = 0;
    unsigned int n = 0;
    for (;;) {
        char c = **p;
        int d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            d = c - 'A' + 10;
        else
            break;
        v = v * 16 + (unsigned long)d;
        ++n;
        ++*p;
    }
    if (n == 0 || n > max_digits)
        *ok = 0;
    return (unsigned int)v;
}

/* Accepts "domain:bus:device.function" with a 4- or 8-digit domain, and
 * "bus:device.function", the spellings NVML's own lookup accepts. */
static int parse_pci(const char *s, unsigned int *domain, unsigned int *bus,
                     unsigned int *device, unsigned int *function)
{
    const char *p = s;
    unsigned int a, b;
    int ok = 1;

    a = parse_hex_field(&p, 8, &ok);
    if (!ok || *p++ != ':')
        return 0;
    b = parse_hex_field(&p, 8, &ok);
    if (!ok)
        return 0;
    if (*p == ':') {
        ++p;
        *domain = a;
        *bus = b;
        *device = parse_hex_field(&p, 2, &ok);
    } else {
        *domain = 0;
        *bus = a;
        *device = b;
    }
    if (!ok || *p++ != '.')
        return 0;
    *function = parse_hex_field(&p, 1, &ok);
    return ok && *p == '\0' && *bus <= 0xff && *device <= 0x1f && *function <= 7;
}

static int copy_token(char *dst, size_t size, const char *src)
{
    size_t n = strlen(src);
    if (n == 0 || n >= size)
        return 0;
    memcpy(dst, src, n + 1);
    return 1;
}

static int parse_gpu(struct parse_ctx *ctx, struct state *st, char **save)
{
    struct fake_gpu *gpu;
    unsigned long long index, v;
    int have_uuid = 0, have_name = 0, have_pci = 0, have_total = 0, have_minor = 0;
    char *tok = strtok_r(NULL, DELIMS, save);

    if (!parse_ull(tok, &index) || index != st->gpu_count) {
        parse_error(ctx, "gpu records must be numbered 0, 1, 2... in order, got", tok);
        return 0;
    }
    if (st->gpu_count >= MAX_GPUS) {
        parse_error(ctx, "too many gpu records", NULL);
        return 0;
    }
    gpu = &st->gpus[st->gpu_count];
    memset(gpu, 0, sizeof *gpu);
    gpu->mig_mode = MIG_UNSUPPORTED;
    gpu->nvlinks = -1;

    while ((tok = strtok_r(NULL, DELIMS, save)) != NULL) {
        char *value = strchr(tok, '=');
        if (strcmp(tok, "lost") == 0) {
            gpu->lost = 1;
            continue;
        }
        if (value == NULL) {
            parse_error(ctx, "expected key=value or 'lost', got", tok);
            return 0;
        }
        *value++ = '\0';
        if (strcmp(tok, "uuid") == 0) {
            have_uuid = copy_token(gpu->uuid, sizeof gpu->uuid, value);
            if (!have_uuid) {
                parse_error(ctx, "bad uuid", value);
                return 0;
            }
        } else if (strcmp(tok, "name") == 0) {
            char *c;
            have_name = copy_token(gpu->name, sizeof gpu->name, value);
            if (!have_name) {
                parse_error(ctx, "bad name", value);
                return 0;
            }
            for (c = gpu->name; *c; ++c)
                if (*c == '_')
                    *c = ' ';
        } else if (strcmp(tok, "minor") == 0) {
            if (!parse_ull(value, &v) || v > UINT_MAX) {
                parse_error(ctx, "bad minor", value);
                return 0;
            }
            gpu->minor = (unsigned int)v;
            have_minor = 1;
        } else if (strcmp(tok, "pci") == 0) {
            have_pci = parse_pci(value, &gpu->pci_domain, &gpu->pci_bus, &gpu->pci_device,
                                 &gpu->pci_function);
            if (!have_pci) {
                parse_error(ctx, "bad pci bus id", value);
                return 0;
            }
        } else if (strcmp(tok, "total") == 0) {
            have_total = parse_ull(value, &gpu->total);
            if (!have_total) {
                parse_error(ctx, "bad total", value);
                return 0;
            }
        } else if (strcmp(tok, "used") == 0) {
            if (!parse_ull(value, &gpu->base_used)) {
                parse_error(ctx, "bad used", value);
                return 0;
            }
        } else if (strcmp(tok, "handle_error") == 0) {
            if (!parse_code(value, &gpu->handle_error)) {
                parse_error(ctx, "bad handle_error", value);
                return 0;
            }
        } else if (strcmp(tok, "reserved") == 0) {
            if (!parse_ull(value, &gpu->reserved)) {
                parse_error(ctx, "bad reserved", value);
                return 0;
            }
        } else if (strcmp(tok, "mig") == 0) {
            if (strcmp(value, "on") == 0)
                gpu->mig_mode = MIG_ENABLE;
            else if (strcmp(value, "off") == 0)
                gpu->mig_mode = MIG_DISABLE;
            else {
                parse_error(ctx, "mig must be on or off, got", value);
                return 0;
            }
        } else if (strcmp(tok, "persistence") == 0) {
            if (strcmp(value, "on") != 0 && strcmp(value, "off") != 0) {
                parse_error(ctx, "persistence must be on or off, got", value);
                return 0;
            }
            gpu->persistence = strcmp(value, "on") == 0;
        } else if (strcmp(tok, "nvlink") == 0) {
            if (!parse_ull(value, &v) || v > NVLINK_MAX_LINKS) {
                parse_error(ctx, "bad nvlink (active links, 0-18)", value);
                return 0;
            }
            gpu->nvlinks = (int)v;
        } else if (strcmp(tok, "mig_parent_lists") == 0) {
            if (strcmp(value, "aggregate") == 0)
                gpu->parent_aggregate = 1;
            else if (strcmp(value, "empty") == 0)
                gpu->parent_aggregate = 0;
            else {
                parse_error(ctx, "mig_parent_lists must be empty or aggregate, got", value);
                return 0;
            }
        } else {
            parse_error(ctx, "unknown gpu key", tok);
            return 0;
        }
    }
    if (!have_uuid || !have_name || !have_pci || !have_total) {
        parse_error(ctx, "gpu record needs uuid=, name=, pci= and total=", NULL);
        return 0;
    }
    if (!have_minor)
        gpu->minor = (unsigned int)index;
    ++st->gpu_count;
    return 1;
}

static struct fake_mig *find_mig(struct state *st, unsigned int gpu, unsigned long long slot)
{
    unsigned int i;
    for (i = 0; i < st->mig_count; ++i)
        if (st->migs[i].gpu == gpu && st->migs[i].slot == slot)
            return &st->migs[i];
    return NULL;
}

static int parse_proc(struct parse_ctx *ctx, struct state *st, char **save)
{
    struct fake_proc *proc;
    unsigned long long gpu, pid;
    char *tok;

    if (st->proc_count >= MAX_PROCS) {
        parse_error(ctx, "too many proc records", NULL);
        return 0;
    }
    proc = &st->procs[st->proc_count];
    memset(proc, 0, sizeof *proc);

    tok = strtok_r(NULL, DELIMS, save);
    /* gpu records come first, so an index past them is a typo, not a
     * forward reference. */
    if (!parse_ull(tok, &gpu) || gpu >= st->gpu_count) {
        parse_error(ctx, "proc names no gpu listed above it", tok);
        return 0;
    }
    proc->gpu = (unsigned int)gpu;
    proc->mig_slot = NO_MIG;

    tok = strtok_r(NULL, DELIMS, save);
    /* Range-checked below, once "raw" is known. */
    if (!parse_ull(tok, &pid) || pid > UINT_MAX) {
        parse_error(ctx, "bad pid", tok);
        return 0;
    }
    proc->raw_pid = (unsigned int)pid;

    tok = strtok_r(NULL, DELIMS, save);
    if (!parse_ull(tok, &proc->used)) {
        parse_error(ctx, "bad bytes used", tok);
        return 0;
    }

    tok = strtok_r(NULL, DELIMS, save);
    if (tok != NULL && strcmp(tok, "compute") == 0)
        proc->kind = KIND_COMPUTE;
    else if (tok != NULL && strcmp(tok, "graphics") == 0)
        proc->kind = KIND_GRAPHICS;
    else if (tok != NULL && strcmp(tok, "mps") == 0)
        proc->kind = KIND_MPS;
    else {
        parse_error(ctx, "proc kind must be compute, graphics or mps, got", tok);
        return 0;
    }

    proc->listed_ms = ULLONG_MAX;
    while ((tok = strtok_r(NULL, DELIMS, save)) != NULL) {
        unsigned long long *field;
        const char *value;
        if (strcmp(tok, "raw") == 0) {
            proc->raw = 1;
            continue;
        }
        if (strncmp(tok, "mig=", 4) == 0) {
            unsigned long long slot;
            if (!parse_ull(tok + 4, &slot) || find_mig(st, proc->gpu, slot) == NULL) {
                parse_error(ctx, "proc names no MIG instance listed above it on its gpu", tok);
                return 0;
            }
            proc->mig_slot = (unsigned int)slot;
            continue;
        }
        if (strncmp(tok, "host_pid=", 9) == 0) {
            unsigned long long host;
            if (!parse_ull(tok + 9, &host) || host == 0 || host > INT_MAX) {
                parse_error(ctx, "bad host_pid", tok);
                return 0;
            }
            proc->host_pid = (unsigned int)host;
            continue;
        }
        if (strncmp(tok, "release_delay_ms=", 17) == 0) {
            field = &proc->release_delay_ms;
            value = tok + 17;
        } else if (strncmp(tok, "listed_ms=", 10) == 0) {
            field = &proc->listed_ms;
            value = tok + 10;
        } else if (strncmp(tok, "release_ms=", 11) == 0) {
            field = &proc->release_ms;
            value = tok + 11;
        } else if (strncmp(tok, "wobble=", 7) == 0) {
            field = &proc->wobble;
            value = tok + 7;
        } else if (strncmp(tok, "wobble_ms=", 10) == 0) {
            field = &proc->wobble_ms;
            value = tok + 10;
        } else {
            parse_error(ctx, "unexpected proc field", tok);
            return 0;
        }
        if (!parse_ull(value, field) || *field > ULLONG_MAX / 1000000ull) {
            parse_error(ctx, "bad proc field value", tok);
            return 0;
        }
    }
    /* kill(0, 0) and kill(-1, 0) address process groups, which would make
     * every liveness check lie; only a raw record, never checked, may say
     * anything. */
    if (!proc->raw && (pid == 0 || pid > INT_MAX)) {
        parse_error(ctx, "bad pid (only a raw record may list 0 or one past INT_MAX)", NULL);
        return 0;
    }
    proc->pid = proc->raw ? 0 : (pid_t)pid;
    if (proc->raw && proc->host_pid) {
        parse_error(ctx, "a raw record is listed as written; host_pid= makes no sense there", NULL);
        return 0;
    }
    if (proc->mig_slot == NO_MIG && st->gpus[proc->gpu].mig_mode == MIG_ENABLE) {
        /* A GPU in MIG mode runs nothing outside its instances. */
        parse_error(ctx, "a proc on a GPU in MIG mode needs mig=SLOT", NULL);
        return 0;
    }
    ++st->proc_count;
    return 1;
}

static int parse_mig(struct parse_ctx *ctx, struct state *st, char **save)
{
    struct fake_mig *mig;
    unsigned long long gpu, slot, v;
    int have_uuid = 0, have_gi = 0, have_ci = 0, have_total = 0;
    char *tok;

    if (st->mig_count >= MAX_MIGS) {
        parse_error(ctx, "too many mig records", NULL);
        return 0;
    }
    mig = &st->migs[st->mig_count];
    memset(mig, 0, sizeof *mig);
    tok = strtok_r(NULL, DELIMS, save);
    if (!parse_ull(tok, &gpu) || gpu >= st->gpu_count) {
        parse_error(ctx, "mig names no gpu listed above it", tok);
        return 0;
    }
    if (st->gpus[gpu].mig_mode != MIG_ENABLE) {
        parse_error(ctx, "mig instance on a gpu without mig=on", tok);
        return 0;
    }
    tok = strtok_r(NULL, DELIMS, save);
    if (!parse_ull(tok, &slot) || slot >= MIG_SLOTS || find_mig(st, (unsigned int)gpu, slot)) {
        parse_error(ctx, "mig slot must be 0-6 and unused on its gpu, got", tok);
        return 0;
    }
    mig->gpu = (unsigned int)gpu;
    mig->slot = (unsigned int)slot;
    while ((tok = strtok_r(NULL, DELIMS, save)) != NULL) {
        char *value = strchr(tok, '=');
        if (value == NULL) {
            parse_error(ctx, "expected key=value, got", tok);
            return 0;
        }
        *value++ = '\0';
        if (strcmp(tok, "uuid") == 0) {
            have_uuid = copy_token(mig->uuid, sizeof mig->uuid, value);
        } else if (strcmp(tok, "gi") == 0 || strcmp(tok, "ci") == 0) {
            if (!parse_ull(value, &v) || v >= NO_MIG) {
                parse_error(ctx, "bad instance id", value);
                return 0;
            }
            if (tok[0] == 'g') {
                mig->gi = (unsigned int)v;
                have_gi = 1;
            } else {
                mig->ci = (unsigned int)v;
                have_ci = 1;
            }
        } else if (strcmp(tok, "total") == 0) {
            have_total = parse_ull(value, &mig->total);
        } else if (strcmp(tok, "used") == 0) {
            if (!parse_ull(value, &mig->base_used)) {
                parse_error(ctx, "bad used", value);
                return 0;
            }
        } else {
            parse_error(ctx, "unknown mig key", tok);
            return 0;
        }
    }
    if (!have_uuid || !have_gi || !have_ci || !have_total) {
        parse_error(ctx, "mig record needs uuid=, gi=, ci= and total=", NULL);
        return 0;
    }
    ++st->mig_count;
    return 1;
}

static int parse_line(struct parse_ctx *ctx, struct state *st, char *line)
{
    char *save = NULL;
    char *hash = strchr(line, '#');
    char *kw, *a, *b;

    if (hash != NULL)
        *hash = '\0';
    kw = strtok_r(line, DELIMS, &save);
    if (kw == NULL)
        return 1;

    if (strcmp(kw, "gpu") == 0)
        return parse_gpu(ctx, st, &save);
    if (strcmp(kw, "proc") == 0)
        return parse_proc(ctx, st, &save);
    if (strcmp(kw, "node") == 0) {
        a = strtok_r(NULL, DELIMS, &save);
        if (a == NULL || strtok_r(NULL, DELIMS, &save) != NULL || st->node_count >= MAX_NODES ||
            !copy_token(st->nodes[st->node_count], NODE_PATH_SIZE, a)) {
            parse_error(ctx, "expected 'node PATH' (at most 64)", a);
            return 0;
        }
        ++st->node_count;
        return 1;
    }
    if (strcmp(kw, "mig") == 0)
        return parse_mig(ctx, st, &save);

    a = strtok_r(NULL, DELIMS, &save);
    b = strtok_r(NULL, DELIMS, &save);
    if (strcmp(kw, "driver") == 0) {
        if (!a || b || !copy_token(st->driver, sizeof st->driver, a)) {
            parse_error(ctx, "expected 'driver VERSION'", NULL);
            return 0;
        }
    } else if (strcmp(kw, "init_error") == 0) {
        if (!a || b || !parse_code(a, &st->init_error)) {
            parse_error(ctx, "expected 'init_error CODE'", NULL);
            return 0;
        }
    } else if (strcmp(kw, "fail") == 0) {
        struct fail_rule *rule;
        if (st->fail_count >= MAX_FAILS) {
            parse_error(ctx, "too many fail records", NULL);
            return 0;
        }
        rule = &st->fails[st->fail_count];
        if (!a || !b || strtok_r(NULL, DELIMS, &save) != NULL ||
            !copy_token(rule->function, sizeof rule->function, a) || !parse_code(b, &rule->code)) {
            parse_error(ctx, "expected 'fail FUNCTION CODE'", NULL);
            return 0;
        }
        ++st->fail_count;
    } else if (strcmp(kw, "hang") == 0) {
        struct hang_rule *rule;
        unsigned long long gpu = 0;
        char *c = strtok_r(NULL, DELIMS, &save);
        if (st->hang_count >= MAX_HANGS) {
            parse_error(ctx, "too many hang records", NULL);
            return 0;
        }
        rule = &st->hangs[st->hang_count];
        rule->gpu = -1;
        if (!a || !b || !copy_token(rule->function, sizeof rule->function, a) ||
            !parse_ull(b, &rule->ms) || rule->ms > ULLONG_MAX / 1000000ull ||
            (c != NULL && (!parse_ull(c, &gpu) || gpu >= MAX_GPUS)) ||
            strtok_r(NULL, DELIMS, &save) != NULL) {
            parse_error(ctx, "expected 'hang FUNCTION MS [GPU]'", NULL);
            return 0;
        }
        if (c != NULL)
            rule->gpu = (int)gpu;
        ++st->hang_count;
    } else {
        parse_error(ctx, "unknown record", kw);
        return 0;
    }
    return 1;
}

/* Forget exited pids that no record mentions any more, which also bounds
 * the table: it can never hold more pids than there are proc records. */
static void prune_dead_table(void)
{
    unsigned int i, j, kept = 0;
    for (i = 0; i < g_dead_count; ++i) {
        for (j = 0; j < g_state.proc_count; ++j)
            if (g_state.procs[j].pid == g_dead[i].pid)
                break;
        if (j < g_state.proc_count)
            g_dead[kept++] = g_dead[i];
    }
    g_dead_count = kept;
}

/* Caller holds g_lock.  NVML_ERROR_DRIVER_NOT_LOADED when the file cannot
 * be opened (no driver, as far as callers can tell), NVML_ERROR_UNKNOWN
 * when it is malformed; g_state is untouched unless the whole file parsed. */
static nvmlReturn_t load_state(void)
{
    const char *path = getenv("FAKE_NVML_STATE");
    struct parse_ctx ctx;
    char line[MAX_LINE];
    FILE *f;
    int ok = 1;

    if (path == NULL || *path == '\0')
        path = DEFAULT_STATE_PATH;
    f = fopen(path, "r");
    if (f == NULL)
        return NVML_ERROR_DRIVER_NOT_LOADED;

    memset(&g_scratch, 0, sizeof g_scratch);
    memcpy(g_scratch.driver, DEFAULT_DRIVER, sizeof DEFAULT_DRIVER);
    ctx.path = path;
    ctx.line = 0;
    while (ok && fgets(line, sizeof line, f) != NULL) {
        ++ctx.line;
        if (strchr(line, '\n') == NULL && !feof(f)) {
            parse_error(&ctx, "line too long", NULL);
            ok = 0;
            break;
        }
        ok = parse_line(&ctx, &g_scratch, line);
    }
    if (ok && ferror(f))
        ok = 0;
    fclose(f);
    if (!ok)
        return NVML_ERROR_UNKNOWN;

    memcpy(&g_state, &g_scratch, sizeof g_state);
    prune_dead_table();
    return NVML_SUCCESS;
}

/* ---- liveness ------------------------------------------------------ */

static int pid_alive(pid_t pid)
{
    /* EPERM means the pid exists but belongs to someone else; a zombie
     * answers 0.  Both still hold a real driver context. */
    return kill(pid, 0) == 0 || errno == EPERM;
}

/* "dead PID NS" to $FAKE_NVML_EVENTS, if set (the header comment). */
static void note_dead(pid_t pid, unsigned long long now)
{
    const char *path = getenv("FAKE_NVML_EVENTS");
    char line[64];
    int fd, n;
    if (path == NULL || *path == '\0')
        return;
    n = snprintf(line, sizeof line, "dead %d %llu\n", (int)pid, now);
    fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    if (n > 0 && write(fd, line, (size_t)n) != n) {
        /* a lost line only leaves a benchmark without its figure */
    }
    close(fd);
}

/* Whether the proc's pid is gone, and if so for how long (ns) this library
 * has known it.  Caller holds g_lock. */
static int dead_for(const struct fake_proc *proc, unsigned long long now, unsigned long long *elapsed)
{
    unsigned int i;

    if (proc->raw)
        return 0;
    for (i = 0; i < g_dead_count; ++i)
        if (g_dead[i].pid == proc->pid)
            break;

    if (pid_alive(proc->pid)) {
        /* The pid was reused by a new process: its old death no longer
         * applies. */
        if (i < g_dead_count)
            g_dead[i] = g_dead[--g_dead_count];
        return 0;
    }
    if (i == g_dead_count) {
        /* Cannot overflow: pruning keeps one entry per distinct pid in the
         * state, and the state holds at most MAX_PROCS records. */
        g_dead[g_dead_count].pid = proc->pid;
        g_dead[g_dead_count].first_seen_dead_ns = now;
        ++g_dead_count;
        note_dead(proc->pid, now);
    }
    *elapsed = now - g_dead[i].first_seen_dead_ns;
    return 1;
}

/* Whether the proc still holds memory (listing == 0: alive, or dead for less
 * than its release delay plus release_ms and wobble_ms) or is still listed
 * (listing == 1: its release delay, or listed_ms if shorter). */
static int proc_held(const struct fake_proc *proc, unsigned long long now, int listing)
{
    const unsigned long long most = ULLONG_MAX / 1000000ull;
    unsigned long long delay_ms = proc->release_delay_ms, elapsed, extra;

    if (!dead_for(proc, now, &elapsed))
        return 1;
    if (listing && proc->listed_ms < delay_ms)
        delay_ms = proc->listed_ms;
    extra = listing ? 0 : proc->release_ms + proc->wobble_ms; /* each <= most: no wrap */
    delay_ms = extra > most || delay_ms > most - extra ? most : delay_ms + extra;
    return elapsed < delay_ms * 1000000ull;
}

/* The bytes a counted proc holds now: all of them while alive and during
 * the delay, then falling over release_ms, then wobble for wobble_ms. */
static unsigned long long proc_bytes(const struct fake_proc *proc, unsigned long long now)
{
    unsigned long long elapsed, phase;

    if (!dead_for(proc, now, &elapsed))
        return proc->used;
    phase = proc->release_delay_ms * 1000000ull;
    if (elapsed < phase)
        return proc->used;
    elapsed -= phase;
    phase = proc->release_ms * 1000000ull;
    if (elapsed < phase)
        return proc->used - (unsigned long long)((long double)proc->used * elapsed / phase);
    elapsed -= phase;
    return elapsed < proc->wobble_ms * 1000000ull ? proc->wobble : 0;
}

static int proc_counted(const struct fake_proc *proc, unsigned long long now)
{
    return proc_held(proc, now, 0);
}

static int proc_listed(const struct fake_proc *proc, unsigned long long now)
{
    return proc_held(proc, now, 1);
}

/* ---- call prologue -------------------------------------------------- */

static nvmlReturn_t forced_failure(const char *function)
{
    unsigned int i;
    for (i = 0; i < g_state.fail_count; ++i)
        if (strcmp(g_state.fails[i].function, function) == 0)
            return g_state.fails[i].code;
    return NVML_SUCCESS;
}

/* Blocks for the first hang rule naming `function` (for GPU `gpu`, or -1 for
 * rules that name no GPU), with g_lock held: a stuck driver call holds the
 * driver's locks, so nothing else in this process gets through either. */
static void forced_hang(const char *function, int gpu)
{
    unsigned int i;
    for (i = 0; i < g_state.hang_count; ++i) {
        const struct hang_rule *rule = &g_state.hangs[i];
        if (rule->gpu == gpu && strcmp(rule->function, function) == 0) {
            struct timespec left;
            left.tv_sec = (time_t)(rule->ms / 1000ull);
            left.tv_nsec = (long)(rule->ms % 1000ull) * 1000000L;
            while (nanosleep(&left, &left) != 0 && errno == EINTR)
                ;
            return;
        }
    }
}

/* Locks g_lock, which the caller releases whatever this returns. */
static nvmlReturn_t enter(const char *function)
{
    nvmlReturn_t rc;
    pthread_mutex_lock(&g_lock);
    if (g_init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    rc = load_state();
    if (rc != NVML_SUCCESS)
        return rc;
    forced_hang(function, -1);
    return forced_failure(function);
}

/* $FAKE_NVML_CALLS, when set, gets a line "<gpu index> <function>" for every
 * call that names a GPU (its handle lookup included): the tests' proof that
 * a runtime-suspended GPU is never asked, since any such call would wake a
 * real one.  Appended whole (O_APPEND), so threads never interleave lines. */
static void count_call(const char *function, unsigned int index)
{
    const char *path = getenv("FAKE_NVML_CALLS");
    char line[FUNC_NAME_SIZE + 16];
    int fd, n;
    if (path == NULL || *path == '\0')
        return;
    n = snprintf(line, sizeof line, "%u %s\n", index, function);
    if (n <= 0 || (size_t)n >= sizeof line)
        return;
    fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    if (write(fd, line, (size_t)n) != n) {
        /* a short count only weakens the test's proof; nothing to report to */
    }
    close(fd);
}

static int handle_index(nvmlDevice_t device, unsigned int *index)
{
    /* Compared as integers: relational operators on pointers into
     * different objects are undefined, and a bad handle is exactly that. */
    uintptr_t p = (uintptr_t)device;
    uintptr_t base = (uintptr_t)g_state.gpus;
    uintptr_t slot;
    if (p < base || (p - base) % sizeof g_state.gpus[0] != 0)
        return 0;
    slot = (p - base) / sizeof g_state.gpus[0];
    if (slot >= g_state.gpu_count)
        return 0;
    *index = (unsigned int)slot;
    return 1;
}

static struct fake_mig *mig_of_handle(nvmlDevice_t device)
{
    uintptr_t p = (uintptr_t)device;
    uintptr_t base = (uintptr_t)g_state.migs;
    uintptr_t slot;
    if (p < base || (p - base) % sizeof g_state.migs[0] != 0)
        return NULL;
    slot = (p - base) / sizeof g_state.migs[0];
    return slot < g_state.mig_count ? &g_state.migs[slot] : NULL;
}

/* enter() plus the checks every per-device call shares.  A MIG device
 * handle gets NOT_SUPPORTED: nvml.h lists, per query, the few that take
 * one (UUID, memory, process lists, the MIG queries), and the rest are
 * whole-GPU properties. */
static nvmlReturn_t enter_device(const char *function, nvmlDevice_t device, struct fake_gpu **gpu)
{
    unsigned int index;
    nvmlReturn_t rc = enter(function);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!handle_index(device, &index)) {
        if (mig_of_handle(device) == NULL)
            return NVML_ERROR_INVALID_ARGUMENT;
        count_call(function, mig_of_handle(device)->gpu);
        return NVML_ERROR_NOT_SUPPORTED;
    }
    count_call(function, index);
    forced_hang(function, (int)index);
    *gpu = &g_state.gpus[index];
    return (*gpu)->lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

/* enter_device() for the queries that also take a MIG device handle: *mig
 * is the instance (NULL for a whole GPU) and *gpu its parent, whose loss
 * takes every instance with it. */
static nvmlReturn_t enter_any(const char *function, nvmlDevice_t device, struct fake_gpu **gpu,
                              struct fake_mig **mig)
{
    unsigned int index;
    nvmlReturn_t rc = enter(function);
    *mig = NULL;
    if (rc != NVML_SUCCESS)
        return rc;
    if (handle_index(device, &index)) {
        *gpu = &g_state.gpus[index];
    } else {
        *mig = mig_of_handle(device);
        if (*mig == NULL)
            return NVML_ERROR_INVALID_ARGUMENT;
        *gpu = &g_state.gpus[(*mig)->gpu];
    }
    count_call(function, (unsigned int)(*gpu - g_state.gpus));
    /* A hang named for the GPU takes its instances with it. */
    forced_hang(function, (int)(*gpu - g_state.gpus));
    return (*gpu)->lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

static nvmlReturn_t leave(nvmlReturn_t rc)
{
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static nvmlReturn_t copy_out(char *dst, unsigned int length, const char *src)
{
    size_t n = strlen(src);
    if (dst == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (n >= length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* ---- init / shutdown ------------------------------------------------- */

/* Like libnvidia-ml, which opens /dev/nvidiactl and each GPU's node: a
 * process using NVML holds the devices while it is initialised.  Nodes no
 * driver backs (the tests' major-120 ones) open only O_PATH, which looks
 * the same in /proc/<pid>/fd.  Caller holds g_lock. */
static void open_nodes(void)
{
    unsigned int i;
    for (i = 0; i < g_state.node_count && g_node_fd_count < MAX_NODES; ++i) {
        int fd = open(g_state.nodes[i], O_RDWR | O_CLOEXEC);
        if (fd < 0)
            fd = open(g_state.nodes[i], O_PATH | O_CLOEXEC);
        if (fd >= 0)
            g_node_fds[g_node_fd_count++] = fd;
    }
}

static void close_nodes(void)
{
    while (g_node_fd_count > 0)
        close(g_node_fds[--g_node_fd_count]);
}

static nvmlReturn_t do_init(const char *function)
{
    nvmlReturn_t rc;
    pthread_mutex_lock(&g_lock);
    rc = load_state();
    if (rc == NVML_SUCCESS) {
        forced_hang(function, -1);
        rc = forced_failure(function);
    }
    if (rc == NVML_SUCCESS)
        rc = g_state.init_error;
    if (rc == NVML_SUCCESS && g_init_count++ == 0)
        open_nodes();
    return leave(rc);
}

nvmlReturn_t nvmlInit(void) { return do_init(__func__); }
nvmlReturn_t nvmlInit_v2(void) { return do_init(__func__); }

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return do_init(__func__);
}

nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_init_count == 0)
        return leave(NVML_ERROR_UNINITIALIZED);
    /* A vanished state file must not stop a clean shutdown; it only means
     * no fail rule can apply. */
    if (load_state() == NVML_SUCCESS)
        rc = forced_failure(__func__);
    if (rc == NVML_SUCCESS && --g_init_count == 0)
        close_nodes();
    return leave(rc);
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    /* NVML's own wording, so error text in gpuguard's logs reads the same
     * in tests as in production. */
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED:
        return "The requested vgpu operation is not available on target device, because ECC is "
               "enabled";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient Resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not Ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: return "Reset type not supported";
    case NVML_ERROR_UNKNOWN:
    default: return "Unknown Error";
    }
}

/* ---- system queries -------------------------------------------------- */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = enter(__func__);
    if (rc == NVML_SUCCESS)
        rc = copy_out(version, length, g_state.driver);
    return leave(rc);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    /* Real drivers report "<CUDA major>.<driver version>". */
    char buf[DRIVER_SIZE + 8];
    nvmlReturn_t rc = enter(__func__);
    if (rc == NVML_SUCCESS) {
        snprintf(buf, sizeof buf, "12.%s", g_state.driver);
        rc = copy_out(version, length, buf);
    }
    return leave(rc);
}

/* ---- device enumeration ---------------------------------------------- */

static nvmlReturn_t get_count(const char *function, unsigned int *count)
{
    nvmlReturn_t rc = enter(function);
    if (rc == NVML_SUCCESS && count == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *count = g_state.gpu_count;
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return get_count(__func__, count); }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) { return get_count(__func__, count); }

/* Succeeds for a lost GPU too, as on real drivers: enumeration still sees
 * the device, only talking to it fails.  A GPU with handle_error fails here
 * instead, as lookups do on some drivers (dcgm-exporter issue 604). */
static nvmlReturn_t get_by_index(const char *function, unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t rc = enter(function);
    if (rc == NVML_SUCCESS && (device == NULL || index >= g_state.gpu_count))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        count_call(function, index);
        forced_hang(function, (int)index);
        rc = g_state.gpus[index].handle_error;
    }
    if (rc == NVML_SUCCESS)
        *device = &g_state.gpus[index];
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return get_by_index(__func__, index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    return get_by_index(__func__, index, device);
}

/* Lookups by UUID and bus id report a lost GPU, as NVML documents for
 * them; only index enumeration hands out its handle. */
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    unsigned int i;
    nvmlReturn_t rc = enter(__func__);
    if (rc != NVML_SUCCESS)
        return leave(rc);
    if (uuid == NULL || device == NULL)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (i = 0; i < g_state.gpu_count; ++i) {
        if (strcmp(g_state.gpus[i].uuid, uuid) == 0) {
            if (g_state.gpus[i].lost)
                return leave(NVML_ERROR_GPU_IS_LOST);
            *device = &g_state.gpus[i];
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_NOT_FOUND);
}

static nvmlReturn_t get_by_pci(const char *function, const char *pci_bus_id, nvmlDevice_t *device)
{
    unsigned int domain, bus, dev, fn, i;
    nvmlReturn_t rc = enter(function);
    if (rc != NVML_SUCCESS)
        return leave(rc);
    if (pci_bus_id == NULL || device == NULL || !parse_pci(pci_bus_id, &domain, &bus, &dev, &fn))
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (i = 0; i < g_state.gpu_count; ++i) {
        const struct fake_gpu *g = &g_state.gpus[i];
        if (g->pci_domain == domain && g->pci_bus == bus && g->pci_device == dev &&
            g->pci_function == fn) {
            if (g->lost)
                return leave(NVML_ERROR_GPU_IS_LOST);
            *device = &g_state.gpus[i];
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return get_by_pci(__func__, pciBusId, device);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    return get_by_pci(__func__, pciBusId, device);
}

/* ---- per-device queries ---------------------------------------------- */

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    struct fake_gpu *gpu;
    nvmlReturn_t rc = enter_device(__func__, device, &gpu);
    if (rc == NVML_SUCCESS && index == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *index = (unsigned int)(gpu - g_state.gpus);
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct fake_gpu *gpu;
    struct fake_mig *mig;
    nvmlReturn_t rc = enter_any(__func__, device, &gpu, &mig);
    if (rc == NVML_SUCCESS)
        rc = copy_out(uuid, length, mig != NULL ? mig->uuid : gpu->uuid);
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    struct fake_gpu *gpu;
    nvmlReturn_t rc = enter_device(__func__, device, &gpu);
    if (rc == NVML_SUCCESS)
        rc = copy_out(name, length, gpu->name);
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    struct fake_gpu *gpu;
    nvmlReturn_t rc = enter_device(__func__, device, &gpu);
    if (rc == NVML_SUCCESS && minorNumber == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *minorNumber = gpu->minor;
    return leave(rc);
}

static void format_bus_ids(const struct fake_gpu *gpu, char legacy[16], char full[32])
{
    /* NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT and NVML_DEVICE_PCI_BUS_ID_FMT; the
     * legacy one keeps only 16 bits of domain, which is all its buffer
     * holds.  parse_pci already bounded the fields; the masks let the
     * compiler see that nothing is truncated. */
    unsigned int bus = gpu->pci_bus & 0xffu, dev = gpu->pci_device & 0x1fu;
    unsigned int fn = gpu->pci_function & 0x7u;
    snprintf(legacy, 16, "%04X:%02X:%02X.%X", gpu->pci_domain & 0xffffu, bus, dev, fn);
    snprintf(full, 32, "%08X:%02X:%02X.%X", gpu->pci_domain, bus, dev, fn);
}

static nvmlReturn_t get_pci_legacy(const char *function, nvmlDevice_t device, nvmlPciInfo_v2_t *pci)
{
    struct fake_gpu *gpu;
    char full[32];
    nvmlReturn_t rc = enter_device(function, device, &gpu);
    if (rc == NVML_SUCCESS && pci == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        memset(pci, 0, sizeof *pci);
        format_bus_ids(gpu, pci->busId, full);
        pci->domain = gpu->pci_domain;
        pci->bus = gpu->pci_bus;
        pci->device = gpu->pci_device;
        pci->pciDeviceId = FAKE_PCI_DEVICE_ID;
    }
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_v2_t *pci)
{
    return get_pci_legacy(__func__, device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_v2_t *pci)
{
    return get_pci_legacy(__func__, device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    struct fake_gpu *gpu;
    nvmlReturn_t rc = enter_device(__func__, device, &gpu);
    if (rc == NVML_SUCCESS && pci == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        memset(pci, 0, sizeof *pci);
        format_bus_ids(gpu, pci->busIdLegacy, pci->busId);
        pci->domain = gpu->pci_domain;
        pci->bus = gpu->pci_bus;
        pci->device = gpu->pci_device;
        pci->pciDeviceId = FAKE_PCI_DEVICE_ID;
    }
    return leave(rc);
}

/* The pid NVML's lists show for a proc: as written (raw), the host's
 * (host_pid=), or the pid itself. */
static unsigned int listed_pid(const struct fake_proc *p)
{
    return p->raw ? p->raw_pid : p->host_pid ? p->host_pid : (unsigned int)p->pid;
}

/* Records of one process in one place: same GPU, same instance (or none),
 * same listed pid; only their kinds (lists) differ. */
static int same_process(const struct fake_proc *a, const struct fake_proc *b)
{
    return a->gpu == b->gpu && a->mig_slot == b->mig_slot && listed_pid(a) == listed_pid(b);
}

/* A MIG instance's memory is its own; the parent's is the aggregate over
 * the whole GPU (nvml.h: "In MIG mode, if device handle is provided, the
 * API returns aggregate information"), so it counts every instance. */
static void memory_of(const struct fake_gpu *gpu, const struct fake_mig *mig,
                      unsigned long long *total, unsigned long long *used,
                      unsigned long long *free_)
{
    unsigned int index = (unsigned int)(gpu - g_state.gpus), i;
    unsigned long long now = monotonic_ns();
    *total = mig != NULL ? mig->total : gpu->total;
    *used = mig != NULL ? mig->base_used : gpu->base_used;
    for (i = 0; mig == NULL && i < g_state.mig_count; ++i)
        if (g_state.migs[i].gpu == index)
            *used += g_state.migs[i].base_used;
    for (i = 0; i < g_state.proc_count; ++i) {
        const struct fake_proc *p = &g_state.procs[i];
        unsigned long long most;
        unsigned int j;
        int counted_before = 0;
        if (p->gpu != index || (mig != NULL && p->mig_slot != mig->slot) || !proc_counted(p, now))
            continue;
        /* Each process once (compute + graphics is one process, one
         * figure): the first of its counted records stands for all. */
        for (j = 0; j < i && !counted_before; ++j)
            counted_before = same_process(&g_state.procs[j], p) && proc_counted(&g_state.procs[j], now);
        if (counted_before)
            continue;
        most = proc_bytes(p, now);
        for (j = i + 1; j < g_state.proc_count; ++j) {
            const struct fake_proc *q = &g_state.procs[j];
            if (same_process(q, p) && proc_counted(q, now) && proc_bytes(q, now) > most)
                most = proc_bytes(q, now);
        }
        *used += most;
    }
    /* A test may over-commit a GPU; report it full rather than wrap. */
    *free_ = *used < *total ? *total - *used : 0;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    struct fake_gpu *gpu;
    struct fake_mig *mig;
    nvmlReturn_t rc = enter_any(__func__, device, &gpu, &mig);
    if (rc == NVML_SUCCESS && memory == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        unsigned long long reserved = mig != NULL ? 0 : gpu->reserved;
        memory_of(gpu, mig, &memory->total, &memory->used, &memory->free);
        /* v1 has no "reserved": the driver's own memory reads as used. */
        memory->used += reserved;
        memory->free = memory->used < memory->total ? memory->total - memory->used : 0;
    }
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    struct fake_gpu *gpu;
    struct fake_mig *mig;
    nvmlReturn_t rc = enter_any(__func__, device, &gpu, &mig);
    if (rc == NVML_SUCCESS && memory == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    /* Versioned structs are how NVML keeps old callers safe; a mismatch
     * must fail here too, or a caller passing the wrong version would
     * pass its tests and break on real hardware. */
    if (rc == NVML_SUCCESS && memory->version != NVML_MEMORY_V2)
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (rc == NVML_SUCCESS) {
        /* The driver's reservation is the whole GPU's; an instance reports none. */
        memory->reserved = mig != NULL ? 0 : gpu->reserved;
        memory_of(gpu, mig, &memory->total, &memory->used, &memory->free);
        memory->free = memory->free > memory->reserved ? memory->free - memory->reserved : 0;
    }
    return leave(rc);
}

/* ---- running processes ---------------------------------------------- */

/* Whether a list of `gpu` (or of its instance `mig`) shows proc `p`.  An
 * instance lists its own processes.  A GPU in MIG mode lists them all only
 * in mig_parent_lists=aggregate (nvml.h: aggregate information for a
 * privileged caller); otherwise nothing, which is what an unprivileged
 * caller sees, so per-instance handles are the only place to find them. */
static int proc_on(const struct fake_proc *p, const struct fake_gpu *gpu,
                   const struct fake_mig *mig)
{
    if (p->gpu != (unsigned int)(gpu - g_state.gpus))
        return 0;
    if (mig != NULL)
        return p->mig_slot == mig->slot;
    return gpu->mig_mode != MIG_ENABLE || gpu->parent_aggregate;
}

/* GPU and compute instance ids of a proc, NO_MIG outside MIG, as the
 * _v2/_v3 process structs carry them. */
static void proc_instance(const struct fake_proc *p, unsigned int *gi, unsigned int *ci)
{
    struct fake_mig *mig = p->mig_slot == NO_MIG ? NULL : find_mig(&g_state, p->gpu, p->mig_slot);
    *gi = mig != NULL ? mig->gi : NO_MIG;
    *ci = mig != NULL ? mig->ci : NO_MIG;
}

/* The NVML two-call protocol: when *count is too small (pynvml's first
 * call passes 0 and NULL) report the needed size with INSUFFICIENT_SIZE,
 * except that an empty list succeeds at once. */
static nvmlReturn_t list_procs(const char *function, nvmlDevice_t device, proc_kind kind,
                               unsigned int *count, nvmlProcessInfo_v1_t *infos_v1,
                               nvmlProcessInfo_t *infos, nvmlProcessDetail_v1_t *details)
{
    struct fake_gpu *gpu;
    struct fake_mig *mig;
    unsigned int i, needed = 0, n = 0;
    unsigned long long now = monotonic_ns();
    nvmlReturn_t rc = enter_any(function, device, &gpu, &mig);

    if (rc != NVML_SUCCESS)
        return leave(rc);
    if (count == NULL)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (i = 0; i < g_state.proc_count; ++i) {
        const struct fake_proc *p = &g_state.procs[i];
        if (proc_on(p, gpu, mig) && p->kind == kind && proc_listed(p, now))
            ++needed;
    }
    if (needed > *count) {
        *count = needed;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if (needed > 0 && infos_v1 == NULL && infos == NULL && details == NULL)
        return leave(NVML_ERROR_INVALID_ARGUMENT);

    /* Liveness is sampled again below and a pid can be reused in between;
     * bounding by the first count keeps that from overrunning the buffer. */
    for (i = 0; i < g_state.proc_count && n < needed; ++i) {
        const struct fake_proc *p = &g_state.procs[i];
        if (!proc_on(p, gpu, mig) || p->kind != kind || !proc_listed(p, now))
            continue;
        if (details != NULL) {
            memset(&details[n], 0, sizeof details[n]);
            details[n].pid = listed_pid(p);
            details[n].usedGpuMemory = p->used;
            proc_instance(p, &details[n].gpuInstanceId, &details[n].computeInstanceId);
        } else if (infos != NULL) {
            infos[n].pid = listed_pid(p);
            infos[n].usedGpuMemory = p->used;
            proc_instance(p, &infos[n].gpuInstanceId, &infos[n].computeInstanceId);
        } else {
            infos_v1[n].pid = listed_pid(p);
            infos_v1[n].usedGpuMemory = p->used;
        }
        ++n;
    }
    *count = n;
    return leave(NVML_SUCCESS);
}

#ifdef FAKE_NVML_R535_EARLY
/* The driver bug itself: the caller's array is taken for 32-byte entries. */
#define V3_OUT(infos) NULL, (nvmlProcessDetail_v1_t *)(void *)(infos)
#else
#define V3_OUT(infos) infos, NULL
#endif

#define PROC_LIST_API(name, kind)                                                              \
    nvmlReturn_t name(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_v1_t *infos) \
    {                                                                                          \
        return list_procs(#name, device, kind, infoCount, infos, NULL, NULL);                 \
    }                                                                                          \
    nvmlReturn_t name##_v2(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos) \
    {                                                                                          \
        return list_procs(#name "_v2", device, kind, infoCount, NULL, infos, NULL);           \
    }                                                                                          \
    nvmlReturn_t name##_v3(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos) \
    {                                                                                          \
        return list_procs(#name "_v3", device, kind, infoCount, NULL, V3_OUT(infos));         \
    }

PROC_LIST_API(nvmlDeviceGetComputeRunningProcesses, KIND_COMPUTE)
PROC_LIST_API(nvmlDeviceGetGraphicsRunningProcesses, KIND_GRAPHICS)
PROC_LIST_API(nvmlDeviceGetMPSComputeRunningProcesses, KIND_MPS)

#ifndef FAKE_NVML_R535_EARLY
/* Drivers from 535.104 on: one call per mode, the count and the array in a
 * versioned struct, the same two-call protocol. */
nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device,
                                                   nvmlProcessDetailList_v1_t *plist)
{
    static const proc_kind kinds[] = {KIND_COMPUTE, KIND_GRAPHICS, KIND_MPS};
    if (plist == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (plist->version != NVML_PROCESS_DETAIL_LIST_V1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (plist->mode >= sizeof kinds / sizeof kinds[0])
        return NVML_ERROR_INVALID_ARGUMENT;
    return list_procs(__func__, device, kinds[plist->mode], &plist->numProcArrayEntries, NULL,
                      NULL, plist->procArray);
}
#endif

/* Exported by every driver since 535 (and so by both builds); these GPUs
 * have no confidential computing. */
nvmlReturn_t nvmlDeviceGetConfComputeMemSizeInfo(nvmlDevice_t device, void *memInfo)
{
    struct fake_gpu *gpu;
    nvmlReturn_t rc = enter_device(__func__, device, &gpu);
    if (rc == NVML_SUCCESS)
        rc = memInfo == NULL ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_NOT_SUPPORTED;
    return leave(rc);
}

/* ---- MIG ------------------------------------------------------------- */

/* What real drivers do, from nvml.h (R470 and later) and NVIDIA's MIG user
 * guide:
 *  - nvmlDeviceGetMigMode: current and pending mode of a MIG-capable GPU,
 *    NOT_SUPPORTED on a GPU that cannot do MIG (and on a MIG handle);
 *  - nvmlDeviceGetMaxMigDeviceCount: how many MIG devices the GPU can hold
 *    (7 on A100/H100/H200), NOT_SUPPORTED where MIG is not;
 *  - nvmlDeviceGetMigDeviceHandleByIndex: NOT_SUPPORTED unless MIG mode is
 *    on, INVALID_ARGUMENT past the maximum, NOT_FOUND where no instance
 *    sits at that index: callers must walk all indices, gaps included;
 *  - a MIG handle answers UUID ("MIG-..."), memory (its own slice) and the
 *    process lists (its own tenants, with GPU/compute instance ids in the
 *    _v2/_v3 structs), plus the MIG queries below;
 *  - the parent's memory is the aggregate, and its process lists are
 *    empty for an unprivileged caller (mig_parent_lists=aggregate shows
 *    what root sees).
 * pynvml passes every out-parameter by reference (byref(c_uint()) and
 * byref(c_nvmlDevice_t())), so these take pointers and return codes. */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                  unsigned int *pendingMode)
{
    struct fake_gpu *gpu;
    nvmlReturn_t rc = enter_device(__func__, device, &gpu);
    if (rc == NVML_SUCCESS && (currentMode == NULL || pendingMode == NULL))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && gpu->mig_mode == MIG_UNSUPPORTED)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        *currentMode = *pendingMode = (unsigned int)gpu->mig_mode;
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    struct fake_gpu *gpu;
    nvmlReturn_t rc = enter_device(__func__, device, &gpu);
    if (rc == NVML_SUCCESS && count == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && gpu->mig_mode == MIG_UNSUPPORTED)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        *count = MIG_SLOTS;
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *migDevice)
{
    struct fake_gpu *gpu;
    struct fake_mig *mig = NULL;
    nvmlReturn_t rc = enter_device(__func__, device, &gpu);
    if (rc == NVML_SUCCESS && migDevice == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && gpu->mig_mode != MIG_ENABLE)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS && index >= MIG_SLOTS)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        mig = find_mig(&g_state, (unsigned int)(gpu - g_state.gpus), index);
        if (mig == NULL)
            rc = NVML_ERROR_NOT_FOUND;
        else
            *migDevice = (nvmlDevice_t)(void *)mig;
    }
    return leave(rc);
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    struct fake_gpu *gpu;
    struct fake_mig *mig;
    nvmlReturn_t rc = enter_any(__func__, device, &gpu, &mig);
    if (rc == NVML_SUCCESS && isMigDevice == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *isMigDevice = mig != NULL;
    return leave(rc);
}

/* The instance ids of a MIG handle; a whole GPU has none (NOT_SUPPORTED). */
static nvmlReturn_t get_instance_id(const char *function, nvmlDevice_t device, unsigned int *id,
                                    int compute)
{
    struct fake_gpu *gpu;
    struct fake_mig *mig;
    nvmlReturn_t rc = enter_any(function, device, &gpu, &mig);
    if (rc == NVML_SUCCESS && id == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && mig == NULL)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        *id = compute ? mig->ci : mig->gi;
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return get_instance_id(__func__, device, id, 0);
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return get_instance_id(__func__, device, id, 1);
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                          nvmlDevice_t *device)
{
    struct fake_gpu *gpu;
    struct fake_mig *mig;
    nvmlReturn_t rc = enter_any(__func__, migDevice, &gpu, &mig);
    if (rc == NVML_SUCCESS && device == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && mig == NULL)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        *device = gpu;
    return leave(rc);
}

/* ---- persistence mode and NVLink (a GPU reset) -------------------------
 *
 * persistence=on on a gpu record is the mode at start;
 * nvmlDeviceSetPersistenceMode writes it to STATE.persistence.N (N the
 * index), which wins from then on, so the change outlives this process as
 * the driver's does, and tests/fakenvml/nvidia-smi (the fake reset, which
 * refuses while the mode is on, as the real one does) reads it there.
 * nvlink=N makes links 0..N-1 active; without it the GPU has no NVLink and
 * nvmlDeviceGetNvLinkState answers NOT_SUPPORTED. */

static void persistence_path(char *buf, size_t size, unsigned int index)
{
    const char *path = getenv("FAKE_NVML_STATE");
    if (path == NULL || *path == '\0')
        path = DEFAULT_STATE_PATH;
    snprintf(buf, size, "%s.persistence.%u", path, index);
}

static int persistence_of(const struct fake_gpu *gpu)
{
    char path[NODE_PATH_SIZE + 32];
    FILE *f;
    int c;
    persistence_path(path, sizeof path, (unsigned int)(gpu - g_state.gpus));
    f = fopen(path, "r");
    if (f == NULL)
        return gpu->persistence;
    c = fgetc(f);
    fclose(f);
    return c == '1';
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, unsigned int *mode)
{
    struct fake_gpu *gpu = NULL;
    nvmlReturn_t rc = enter_device(__func__, device, &gpu);
    if (rc == NVML_SUCCESS && mode == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *mode = (unsigned int)persistence_of(gpu);
    return leave(rc);
}

nvmlReturn_t nvmlDeviceSetPersistenceMode(nvmlDevice_t device, unsigned int mode)
{
    struct fake_gpu *gpu = NULL;
    char path[NODE_PATH_SIZE + 32];
    FILE *f;
    nvmlReturn_t rc = enter_device(__func__, device, &gpu);
    if (rc == NVML_SUCCESS && mode > 1)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        persistence_path(path, sizeof path, (unsigned int)(gpu - g_state.gpus));
        f = fopen(path, "w");
        if (f == NULL || fprintf(f, "%u\n", mode) < 0)
            rc = NVML_ERROR_UNKNOWN;
        if (f != NULL && fclose(f) != 0)
            rc = NVML_ERROR_UNKNOWN;
    }
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, unsigned int *isActive)
{
    struct fake_gpu *gpu = NULL;
    nvmlReturn_t rc = enter_device(__func__, device, &gpu);
    if (rc == NVML_SUCCESS && gpu->nvlinks < 0)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS && (isActive == NULL || link >= NVLINK_MAX_LINKS))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *isActive = link < (unsigned int)gpu->nvlinks;
    return leave(rc);
}
