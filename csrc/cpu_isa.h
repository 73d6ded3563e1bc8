// The instruction-set levels the native CPU kernels are compiled for, and the one they run at:
// the best this CPU has, held lower for the process by FASTATTN_CPU_ISA (read when the extension
// loads) and within that by set_cpu_isa, so that one machine runs, tests and times every level it
// supports.
//
// A kernel is an always-inlined body compiled once per level by FASTATTN_PER_ISA and chosen on
// every call by the level in use. GCC's target_clones would pick by the CPU alone, with no way to
// hold it lower.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace fastattn {

// Lowest first. kScalar is the portable C++ built for the baseline (x86-64: SSE2; aarch64: NEON,
// auto-vectorised); kAvx2 is x86-64-v3 (AVX2, FMA); kAvx512 is x86-64-v4 (AVX-512 F/BW/DQ/VL),
// with VNNI and BF16 used where the CPU has them; kAmx is kAvx512 (with VNNI and BF16) and AMX's
// int8 and bf16 tiles for the decoding products (amx_tiles.h); the rest runs its AVX-512 build.
enum class CpuIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

// The best level this CPU runs.
CpuIsa supported_cpu_isa();

// The best level this process may run: the CPU's, held lower by FASTATTN_CPU_ISA.
CpuIsa cpu_isa_limit();

// The level the kernels run at now.
CpuIsa cpu_isa();

// Holds the kernels to `level` or below ("amx", "avx512", "avx2", "scalar"); a level above the limit
// runs at the limit. Returns the level in use. An unknown name is an error.
std::string set_cpu_isa(const std::string &level);

std::string cpu_isa_name(CpuIsa level);

// Extensions within the AVX-512 level: true only when the CPU has them and the level in use is
// AVX-512 or AMX.
bool use_avx512_vnni();
bool use_avx512_bf16();

}  // namespace fastattn

#if defined(__x86_64__) && defined(__GNUC__)
#define FASTATTN_X86 1
#define FASTATTN_TARGET_AVX512 __attribute__((target("arch=x86-64-v4")))
#define FASTATTN_TARGET_AVX2 __attribute__((target("arch=x86-64-v3")))
// Helpers of hand-written AVX2 kernels, inlined into them.
#define FASTATTN_AVX2_INLINE FASTATTN_TARGET_AVX2 inline __attribute__((always_inline))

// Defines name(args...) that runs body(args...), an always-inlined function, compiled for each
// level: x86-64-v4, x86-64-v3 and the baseline, the one called picked by cpu_isa().
#define FASTATTN_PER_ISA(name, body)                                                      \
  template <typename... A>                                                                \
  FASTATTN_TARGET_AVX512 __attribute__((noinline)) decltype(auto) name##_avx512(A &&...a) { \
    return body(std::forward<A>(a)...);                                                   \
  }                                                                                       \
  template <typename... A>                                                                \
  FASTATTN_TARGET_AVX2 __attribute__((noinline)) decltype(auto) name##_avx2(A &&...a) {     \
    return body(std::forward<A>(a)...);                                                   \
  }                                                                                       \
  template <typename... A>                                                                \
  __attribute__((noinline)) decltype(auto) name##_scalar(A &&...a) {                      \
    return body(std::forward<A>(a)...);                                                   \
  }                                                                                       \
  template <typename... A>                                                                \
  inline decltype(auto) name(A &&...a) {                                                  \
    switch (::fastattn::cpu_isa()) {                                                      \
      case ::fastattn::CpuIsa::kAmx:                                                      \
      case ::fastattn::CpuIsa::kAvx512: return name##_avx512(std::forward<A>(a)...);      \
      case ::fastattn::CpuIsa::kAvx2: return name##_avx2(std::forward<A>(a)...);          \
      default: return name##_scalar(std::forward<A>(a)...);                              \
    }                                                                                     \
  }
#else
#define FASTATTN_PER_ISA(name, body)                                                      \
  template <typename... A>                                                                \
  inline decltype(auto) name(A &&...a) {                                                  \
    return body(std::forward<A>(a)...);                                                   \
  }
#endif
