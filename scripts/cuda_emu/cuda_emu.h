// CUDA built-ins on the CPU, for kernels compiled with g++ by scripts/cuda_emu/module.py.
//
// A launch runs its blocks one after another on the calling OS thread; a block's threads are
// fibers (user-level contexts, switched only at barriers), so a kernel runs deterministically
// and needs no atomics. __syncthreads() waits for every thread of the block that has not
// exited; __syncwarp() and the warp collectives (shuffles, votes) for every lane of the mask.
// When no fiber can go on, the launch stops with a deadlock report naming the kernel, the
// block and where each thread waits. Arithmetic is the C++ compiler's IEEE arithmetic with no
// contraction (-ffp-contract=off, as nvcc --fmad=false); with ftz on, the CPU's FTZ and DAZ
// flags flush float (and double) subnormals as nvcc -ftz=true flushes float ones. PTX asm
// statements are translated by module.py into the emu_ptx_* functions below.
#pragma once
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <tuple>
#include <type_traits>
#include <utility>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static
#define __constant__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __CUDA_ARCH__ 900
#define __CUDACC__ 1
#define __CUDACC_RTC__ 1

struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    dim3(unsigned int a = 1, unsigned int b = 1, unsigned int c = 1) : x(a), y(b), z(c) {}
};
static const int warpSize = 32;

#define EMU_VEC2(T, N, A) struct __attribute__((aligned(A))) N##2 { T x, y; }; \
    static inline N##2 make_##N##2(T a, T b) { return {a, b}; }
#define EMU_VEC4(T, N, A) struct __attribute__((aligned(A))) N##4 { T x, y, z, w; }; \
    static inline N##4 make_##N##4(T a, T b, T c, T d) { return {a, b, c, d}; }
EMU_VEC2(float, float, 8) EMU_VEC4(float, float, 16) EMU_VEC2(double, double, 16)
EMU_VEC2(int, int, 8) EMU_VEC4(int, int, 16) EMU_VEC2(unsigned int, uint, 8)
EMU_VEC4(unsigned int, uint, 16) EMU_VEC2(long long, longlong, 16)
EMU_VEC2(unsigned long long, ulonglong, 16) EMU_VEC2(short, short, 4)
EMU_VEC4(short, short, 8) EMU_VEC2(unsigned short, ushort, 4)
EMU_VEC4(unsigned short, ushort, 8) EMU_VEC2(signed char, char, 2) EMU_VEC4(signed char, char, 4)
EMU_VEC2(unsigned char, uchar, 2) EMU_VEC4(unsigned char, uchar, 4)

namespace emu {
enum { RUN, AT_SYNC, AT_WARP, DONE, FAILED };
enum { OK = 0, DEADLOCK = 1, FAULT = 2, TIMEOUT = 3 };
struct Fiber {
    void* sp; char* stack; uint3 tid; int state, lane, warp, line; const char* op;
    unsigned coll, bcoll;  // warp / block collectives done (parity picks the slot buffer)
};
struct Warp { int arrived; unsigned mask, exists; uint64_t slot[2][32]; };
struct Launch {
    const char* name; Fiber* f; int n; Warp* warps; int live, at_sync; uint3 block;
    dim3 bdim, gdim; void (*body)(void*); void* closure; void* sched_sp; char* smem;
    size_t smem_bytes; int err; double deadline; volatile int cancel;
    char msg[4096]; uint64_t bslot[2][1024];
};
static Launch L;
static Fiber* cur;
static int ftz_on;
}  // namespace emu

#define threadIdx (emu::cur->tid)
#define blockIdx (emu::L.block)
#define blockDim (emu::L.bdim)
#define gridDim (emu::L.gdim)

#if defined(__x86_64__)
extern "C" void emu_ctx_switch(void** save, void* to);
asm(".text\n.p2align 4\n.globl emu_ctx_switch\n.hidden emu_ctx_switch\n"
    ".type emu_ctx_switch,@function\nemu_ctx_switch:\n"
    "pushq %rbp\npushq %rbx\npushq %r12\npushq %r13\npushq %r14\npushq %r15\n"
    "movq %rsp, (%rdi)\nmovq %rsi, %rsp\n"
    "popq %r15\npopq %r14\npopq %r13\npopq %r12\npopq %rbx\npopq %rbp\nret\n"
    ".size emu_ctx_switch, .-emu_ctx_switch\n");
#else
#error "cuda_emu: fibers are written for x86-64 only"
#endif

namespace emu {
static const size_t STACK = 256 * 1024;  // per thread (local arrays of up to ~200 KiB)
static char* stacks[1024];

static double now() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static void to_sched() { emu_ctx_switch(&cur->sp, L.sched_sp); }

// Stops the launch with a message (the current thread never resumes).
static void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char* fmt, ...) {
    if (!L.err) {
        int k = snprintf(L.msg, sizeof L.msg, "kernel %s, block (%u,%u,%u), thread (%u,%u,%u): ",
                         L.name, L.block.x, L.block.y, L.block.z, cur->tid.x, cur->tid.y,
                         cur->tid.z);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(L.msg + k, sizeof L.msg - k, fmt, ap);
        va_end(ap);
        L.err = FAULT;
    }
    cur->state = FAILED;
    to_sched();
    __builtin_unreachable();
}

static void release_sync() {
    for (int i = 0; i < L.n; ++i)
        if (L.f[i].state == AT_SYNC) L.f[i].state = RUN;
    L.at_sync = 0;
}

// A block barrier: the last of the live threads to arrive releases the others.
static void block_wait(const char* op, int line) {
    cur->op = op;
    cur->line = line;
    if (++L.at_sync == L.live) { release_sync(); return; }
    cur->state = AT_SYNC;
    to_sched();
}

// A warp barrier over the lanes of `mask` (lanes past the block's end left out).
static void warp_wait(unsigned mask, const char* op, int line) {
    Warp& w = L.warps[cur->warp];
    unsigned need = mask & w.exists;
    if (!((need >> cur->lane) & 1u)) fail("%s (line %d): lane %d not in the mask 0x%08x", op, line, cur->lane, mask);
    if (w.arrived == 0) w.mask = need;
    else if (w.mask != need)
        fail("%s (line %d): lanes of warp %d use masks 0x%08x and 0x%08x at once (not emulated)",
             op, line, cur->warp, w.mask, need);
    cur->op = op;
    cur->line = line;
    if (++w.arrived == __builtin_popcount(need)) {
        for (int l = 0; l < 32; ++l)
            if ((need >> l) & 1u) L.f[cur->warp * 32 + l].state = RUN;
        w.arrived = 0;
        return;
    }
    cur->state = AT_WARP;
    to_sched();
}

static void fiber_entry() {
    L.body(L.closure);
    cur->state = DONE;
    cur->op = "exited";
    cur->line = 0;
    --L.live;
    if (L.at_sync && L.at_sync == L.live) release_sync();  // exited threads count as arrived
    to_sched();
    __builtin_unreachable();
}

static void report_stuck() {
    int k = snprintf(L.msg, sizeof L.msg, "deadlock in kernel %s, block (%u,%u,%u), blockDim "
                     "(%u,%u,%u): no thread can go on;", L.name, L.block.x, L.block.y,
                     L.block.z, L.bdim.x, L.bdim.y, L.bdim.z);
    for (int i = 0; i < L.n && k < (int)sizeof L.msg - 120;) {
        int j = i;
        while (j + 1 < L.n && L.f[j + 1].state == L.f[i].state && L.f[j + 1].op == L.f[i].op &&
               L.f[j + 1].line == L.f[i].line) ++j;
        const Fiber& f = L.f[i];
        k += snprintf(L.msg + k, sizeof L.msg - k, " threads %d-%d: %s", i, j,
                      f.state == DONE ? "exited" : f.op);
        if (f.state != DONE) k += snprintf(L.msg + k, sizeof L.msg - k, " (line %d)", f.line);
        k += snprintf(L.msg + k, sizeof L.msg - k, ";");
        i = j + 1;
    }
}

static int run_block(int nthreads) {
    L.live = nthreads;
    L.at_sync = 0;
    for (int w = 0; w < (nthreads + 31) / 32; ++w) {
        L.warps[w].arrived = 0;
        int m = nthreads - 32 * w;
        L.warps[w].exists = m >= 32 ? 0xffffffffu : ((1u << m) - 1u);
    }
    if (L.smem_bytes) memset(L.smem, 0xff, L.smem_bytes);  // NaN: unwritten shared memory
    for (int i = 0; i < nthreads; ++i) {
        Fiber& f = L.f[i];
        f.tid = {(unsigned)(i % L.bdim.x), (unsigned)(i / L.bdim.x % L.bdim.y),
                 (unsigned)(i / (L.bdim.x * L.bdim.y))};
        f.state = RUN; f.lane = i % 32; f.warp = i / 32; f.coll = f.bcoll = 0;
        f.op = "running"; f.line = 0;
        void** sp = (void**)(f.stack + STACK);
        *--sp = nullptr;  // entry's return address slot: rsp % 16 == 8 on entry
        *--sp = (void*)&fiber_entry;
        for (int r = 0; r < 6; ++r) *--sp = nullptr;
        f.sp = sp;
    }
    for (unsigned sweep = 0;; ++sweep) {
        bool ran = false;
        for (int i = 0; i < nthreads; ++i) {
            if (L.f[i].state != RUN) continue;
            cur = &L.f[i];
            emu_ctx_switch(&L.sched_sp, cur->sp);
            ran = true;
            if (L.err) return L.err;
        }
        if (L.live == 0) return OK;
        if (!ran) { report_stuck(); return DEADLOCK; }
        if ((sweep & 63) == 63 && (L.cancel || now() > L.deadline)) {
            snprintf(L.msg, sizeof L.msg, "kernel %s, block (%u,%u,%u): %s", L.name, L.block.x,
                     L.block.y, L.block.z, L.cancel ? "cancelled" : "timed out");
            return TIMEOUT;
        }
    }
}

// dims: grid x, y, z, block x, y, z. Returns OK or an error code with L.msg set.
static int run_grid(const char* name, void (*body)(void*), void* closure, const unsigned* dims,
                    size_t smem, int ftz, double timeout, char* err, int errlen) {
    L.name = name; L.body = body; L.closure = closure; L.err = OK; L.cancel = 0;
    L.gdim = dim3(dims[0], dims[1], dims[2]);
    L.bdim = dim3(dims[3], dims[4], dims[5]);
    int n = (int)(dims[3] * dims[4] * dims[5]);
    static Fiber fibers[1024];
    static Warp warps[32];
    for (int i = 0; i < n; ++i) {
        if (!stacks[i]) {  // a guard page below each stack: an overflow faults
            char* m = (char*)mmap(nullptr, STACK + 4096, PROT_READ | PROT_WRITE,
                                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            mprotect(m, 4096, PROT_NONE);
            stacks[i] = m + 4096;
        }
        fibers[i].stack = stacks[i];
    }
    L.f = fibers; L.n = n; L.warps = warps;
    L.smem = smem ? (char*)aligned_alloc(256, (smem + 255) / 256 * 256) : nullptr;
    L.smem_bytes = smem;
    L.deadline = now() + timeout;
#if defined(__x86_64__)
    unsigned csr = _mm_getcsr();
    ftz_on = ftz;
    _mm_setcsr(ftz ? (csr | 0x8040u) : (csr & ~0x8040u));  // FTZ | DAZ
#endif
    int rc = OK;
    for (unsigned z = 0; z < dims[2] && rc == OK; ++z)
        for (unsigned y = 0; y < dims[1] && rc == OK; ++y)
            for (unsigned x = 0; x < dims[0] && rc == OK; ++x) {
                L.block = {x, y, z};
                rc = run_block(n);
            }
#if defined(__x86_64__)
    _mm_setcsr(csr);
#endif
    free(L.smem);
    if (rc != OK) snprintf(err, errlen, "%s", L.msg);
    return rc;
}

template <class F> static void call_closure(void* p) { (*(F*)p)(); }

template <class... A, size_t... I>
static void load_args(std::tuple<std::decay_t<A>...>& t, void** args, std::index_sequence<I...>) {
    ((memcpy(&std::get<I>(t), args[I], sizeof(std::get<I>(t)))), ...);
}

template <class... A>
static int launch(const char* name, void (*k)(A...), const unsigned* dims, void** args,
                  size_t smem, int ftz, double timeout, char* err, int errlen) {
    std::tuple<std::decay_t<A>...> vals;
    load_args<A...>(vals, args, std::index_sequence_for<A...>{});
    auto body = [&]() { std::apply(k, vals); };
    return run_grid(name, &call_closure<decltype(body)>, &body, dims, smem, ftz, timeout, err,
                    errlen);
}

// Per parameter: its size and kind (0 pointer, 1 signed integer, 2 unsigned, 3 float, 4 other).
template <class T> static int kind_of() {
    return std::is_pointer<T>::value ? 0 : std::is_floating_point<T>::value ? 3
         : std::is_integral<T>::value ? (std::is_signed<T>::value ? 1 : 2) : 4;
}
template <class... A> static int params(void (*)(A...), int* out, int max) {
    int sizes[] = {0, (int)sizeof(std::decay_t<A>)...}, kinds[] = {0, kind_of<std::decay_t<A>>()...};
    int n = (int)sizeof...(A);
    for (int i = 0; i < n && 2 * i + 1 < max; ++i) { out[2 * i] = sizes[i + 1]; out[2 * i + 1] = kinds[i + 1]; }
    return n;
}

// PTX with IEEE subnormals (no .ftz): computed with the CPU's FTZ/DAZ off for the moment
struct NoFtz {
    unsigned csr = _mm_getcsr();
    NoFtz() { _mm_setcsr(csr & ~0x8040u); }
    ~NoFtz() { _mm_setcsr(csr); }
};
template <class T> static inline T flush(T v) {
    return fabs(v) < (T)(sizeof(T) == 4 ? 1.17549435e-38 : 2.2250738585072014e-308) ? copysign((T)0, v) : v;
}
}  // namespace emu

// (the empty asm statements pin the arithmetic between the MXCSR writes: GCC would move it)
#define EMU_PIN(v) __asm__ __volatile__("" : "+x"(v))
#define EMU_PTX2(NAME, EXPR) \
    template <class T> static inline T emu_ptx_##NAME(T a, T b) { \
        emu::NoFtz g; EMU_PIN(a); EMU_PIN(b); T r = EXPR; EMU_PIN(r); return r; } \
    template <class T> static inline T emu_ptx_##NAME##_ftz(T a, T b) { \
        emu::NoFtz g; a = emu::flush(a); b = emu::flush(b); EMU_PIN(a); EMU_PIN(b); \
        T r = EXPR; EMU_PIN(r); return emu::flush(r); }
EMU_PTX2(add, a + b) EMU_PTX2(sub, a - b) EMU_PTX2(mul, a * b) EMU_PTX2(div, a / b)
template <class T> static inline T emu_ptx_fma(T a, T b, T c) {
    emu::NoFtz g; EMU_PIN(a); EMU_PIN(b); EMU_PIN(c); T r = fma(a, b, c); EMU_PIN(r); return r;
}
template <class T> static inline T emu_ptx_fma_ftz(T a, T b, T c) {
    return emu::flush(emu_ptx_fma(emu::flush(a), emu::flush(b), emu::flush(c)));
}
template <class T> static inline T emu_ptx_sqrt(T a) {
    emu::NoFtz g; EMU_PIN(a); T r = sqrt(a); EMU_PIN(r); return r;
}
static inline unsigned long long emu_ptx_globaltimer() { return (unsigned long long)(emu::now() * 1e9); }

#include "cuda_emu_builtins.h"
