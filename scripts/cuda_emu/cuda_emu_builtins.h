// The CUDA device functions the kernels call, on top of cuda_emu.h's fibers. Functions whose
// device results are approximations (__expf, rsqrtf, ...) are computed exactly here: only
// kernels built from IEEE operations (+ - * / sqrt fma rint) can expect the device's bits.
#pragma once

// ---- bit casts
template <class To, class From> static inline To emu_bits(From v) {
    static_assert(sizeof(To) == sizeof(From), "size");
    To t;
    memcpy(&t, &v, sizeof t);
    return t;
}
static inline float __int_as_float(int v) { return emu_bits<float>(v); }
static inline float __uint_as_float(unsigned int v) { return emu_bits<float>(v); }
static inline int __float_as_int(float v) { return emu_bits<int>(v); }
static inline unsigned int __float_as_uint(float v) { return emu_bits<unsigned int>(v); }
static inline double __longlong_as_double(long long v) { return emu_bits<double>(v); }
static inline long long __double_as_longlong(double v) { return emu_bits<long long>(v); }
static inline int __double2hiint(double v) { return (int)(emu_bits<unsigned long long>(v) >> 32); }
static inline int __double2loint(double v) { return (int)emu_bits<unsigned long long>(v); }
static inline double __hiloint2double(int hi, int lo) {
    return emu_bits<double>(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo);
}

// ---- correctly rounded arithmetic (flushed by ftz as nvcc -ftz=true flushes these)
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __drcp_rn(double a) { return 1.0 / a; }
static inline double __dsqrt_rn(double a) { return sqrt(a); }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
static inline float __saturatef(float v) { return v != v ? 0.0f : fminf(fmaxf(v, 0.0f), 1.0f); }
static inline float fdividef(float a, float b) { return a / b; }
static inline float __fdividef(float a, float b) { return a / b; }
// __expf, __logf, __sinf, __cosf, __powf: glibc's (exact, where the device's are not)
static inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
static inline double rsqrt(double a) { return 1.0 / sqrt(a); }

// ---- min / max of any arithmetic types (floating: fmin / fmax, as CUDA's overloads)
template <class A, class B, class C = std::common_type_t<A, B>>
static inline std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value, C>
max(A a, B b) {
    if constexpr (std::is_floating_point<C>::value) return fmax((C)a, (C)b);
    else return (C)a > (C)b ? (C)a : (C)b;
}
template <class A, class B, class C = std::common_type_t<A, B>>
static inline std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value, C>
min(A a, B b) {
    if constexpr (std::is_floating_point<C>::value) return fmin((C)a, (C)b);
    else return (C)a < (C)b ? (C)a : (C)b;
}

// ---- integer intrinsics
static inline int __popc(unsigned int v) { return __builtin_popcount(v); }
static inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
static inline int __clz(int v) { return v ? __builtin_clz((unsigned)v) : 32; }
static inline int __clzll(long long v) { return v ? __builtin_clzll((unsigned long long)v) : 64; }
static inline int __ffs(int v) { return __builtin_ffs(v); }
static inline int __ffsll(long long v) { return __builtin_ffsll(v); }
static inline unsigned int __brev(unsigned int v) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
    return r;
}
static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
static inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline long long __mul64hi(long long a, long long b) {
    return (long long)(((__int128)a * b) >> 64);
}

// ---- block and warp synchronisation (line: the caller's, for the deadlock report)
static inline void __syncthreads(int line = __builtin_LINE()) { emu::block_wait("__syncthreads", line); }
static inline int emu_block_reduce(int pred, int how, const char* op, int line) {
    int par = emu::cur->bcoll++ & 1, me = emu::cur - emu::L.f;
    emu::L.bslot[par][me] = pred != 0;
    emu::block_wait(op, line);
    int count = 0;
    for (int i = 0; i < emu::L.n; ++i)
        if (emu::L.f[i].state != emu::DONE) count += (int)emu::L.bslot[par][i];
    return how == 0 ? count : how == 1 ? count == emu::L.live : count > 0;
}
static inline int __syncthreads_count(int p, int line = __builtin_LINE()) { return emu_block_reduce(p, 0, "__syncthreads_count", line); }
static inline int __syncthreads_and(int p, int line = __builtin_LINE()) { return emu_block_reduce(p, 1, "__syncthreads_and", line); }
static inline int __syncthreads_or(int p, int line = __builtin_LINE()) { return emu_block_reduce(p, 2, "__syncthreads_or", line); }
static inline void __syncwarp(unsigned mask = 0xffffffffu, int line = __builtin_LINE()) {
    emu::warp_wait(mask, "__syncwarp", line);
}
static inline unsigned __activemask() {
    unsigned m = 0;
    for (int l = 0; l < 32; ++l) {
        int i = emu::cur->warp * 32 + l;
        if (i < emu::L.n && emu::L.f[i].state != emu::DONE) m |= 1u << l;
    }
    return m;
}

// A warp collective: every lane of the mask posts its value, then reads lane src's.
template <class T> static inline T emu_exchange(unsigned mask, T v, int (*src)(int, int, int),
                                                int arg, int width, const char* op, int line) {
    static_assert(sizeof(T) <= 8, "shuffles of up to 8 bytes");
    emu::Fiber* f = emu::cur;
    int par = f->coll++ & 1;
    emu::Warp& w = emu::L.warps[f->warp];
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    w.slot[par][f->lane] = bits;
    emu::warp_wait(mask, op, line);
    int s = src(f->lane, arg, width);
    if (!((w.mask >> s) & 1u)) return v;  // a lane outside the mask: undefined on the device
    T r;
    memcpy(&r, &w.slot[par][s], sizeof(T));
    return r;
}
static inline int emu_src_idx(int lane, int i, int w) { return (lane / w) * w + (i % w); }
static inline int emu_src_xor(int lane, int m, int w) {
    int s = lane ^ m;
    return s / w == lane / w ? s : lane;
}
static inline int emu_src_up(int lane, int d, int w) { return lane % w >= d ? lane - d : lane; }
static inline int emu_src_down(int lane, int d, int w) { return lane % w + d < w ? lane + d : lane; }
template <class T> static inline T __shfl_sync(unsigned m, T v, int i, int w = 32, int line = __builtin_LINE()) {
    return emu_exchange(m, v, emu_src_idx, i, w, "__shfl_sync", line);
}
template <class T> static inline T __shfl_xor_sync(unsigned m, T v, int x, int w = 32, int line = __builtin_LINE()) {
    return emu_exchange(m, v, emu_src_xor, x, w, "__shfl_xor_sync", line);
}
template <class T> static inline T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32, int line = __builtin_LINE()) {
    return emu_exchange(m, v, emu_src_up, (int)d, w, "__shfl_up_sync", line);
}
template <class T> static inline T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32, int line = __builtin_LINE()) {
    return emu_exchange(m, v, emu_src_down, (int)d, w, "__shfl_down_sync", line);
}
static inline unsigned emu_vote(unsigned mask, int pred, const char* op, int line) {
    emu::Fiber* f = emu::cur;
    int par = f->coll++ & 1;
    emu::Warp& w = emu::L.warps[f->warp];
    w.slot[par][f->lane] = pred != 0;
    emu::warp_wait(mask, op, line);
    unsigned b = 0;
    for (int l = 0; l < 32; ++l)
        if (((w.mask >> l) & 1u) && w.slot[par][l]) b |= 1u << l;
    return b;
}
static inline unsigned __ballot_sync(unsigned m, int p, int line = __builtin_LINE()) { return emu_vote(m, p, "__ballot_sync", line); }
static inline int __any_sync(unsigned m, int p, int line = __builtin_LINE()) { return emu_vote(m, p, "__any_sync", line) != 0; }
static inline int __all_sync(unsigned m, int p, int line = __builtin_LINE()) {
    return emu_vote(m, p, "__all_sync", line) == (m & emu::L.warps[emu::cur->warp].exists);
}

// ---- atomics: one OS thread runs the launch, so plain read-modify-writes are atomic
#define EMU_ATOMIC(NAME, EXPR) \
    template <class T, class U> static inline T NAME(T* p, U v) { T o = *p; *p = (T)(EXPR); return o; }
EMU_ATOMIC(atomicAdd, o + v) EMU_ATOMIC(atomicSub, o - v) EMU_ATOMIC(atomicExch, v)
EMU_ATOMIC(atomicMin, v < o ? v : o) EMU_ATOMIC(atomicMax, v > o ? v : o)
EMU_ATOMIC(atomicAnd, o & v) EMU_ATOMIC(atomicOr, o | v) EMU_ATOMIC(atomicXor, o ^ v)
EMU_ATOMIC(atomicInc, o >= (T)v ? 0 : o + 1) EMU_ATOMIC(atomicDec, (o == 0 || o > (T)v) ? (T)v : o - 1)
template <class T> static inline T atomicCAS(T* p, T cmp, T v) { T o = *p; if (o == cmp) *p = v; return o; }

// ---- memory, time
static inline void __threadfence() { __asm__ __volatile__("" ::: "memory"); }
static inline void __threadfence_block() { __threadfence(); }
static inline void __threadfence_system() { __threadfence(); }
static inline void __nanosleep(unsigned) {  // a spinning thread lets the others run
    emu::cur->op = "__nanosleep";
    emu::to_sched();
}
static inline long long clock64() { return (long long)(emu::now() * 1e9); }
template <class T> static inline T __ldg(const T* p) {
    if ((uintptr_t)p % alignof(T)) emu::fail("__ldg of a misaligned %zu-byte value at %p", sizeof(T), (const void*)p);
    return *p;
}
template <class T> static inline T __ldcg(const T* p) { return __ldg(p); }
template <class T> static inline T __ldcs(const T* p) { return __ldg(p); }
template <class T> static inline T __ldca(const T* p) { return __ldg(p); }
template <class T> static inline void __stcg(T* p, T v) { *p = v; }
template <class T> static inline void __stcs(T* p, T v) { *p = v; }
