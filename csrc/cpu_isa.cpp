#include "cpu_isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fastattn {

namespace {

constexpr const char *kNames[] = {"scalar", "avx2", "avx512", "amx"};
constexpr int kLevels = 4;

// Linux hands a process AMX's tile registers (8 KB more state per thread) only on request.
bool amx_granted() {
#if defined(__x86_64__) && defined(__linux__)
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
  return false;
#endif
}

CpuIsa detect() {
#ifdef FASTATTN_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) {
    const bool amx = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
                     __builtin_cpu_supports("amx-bf16") &&
                     __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16");
    return amx && amx_granted() ? CpuIsa::kAmx : CpuIsa::kAvx512;
  }
  if (__builtin_cpu_supports("x86-64-v3")) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kScalar;
}

CpuIsa parse(const std::string &level) {
  for (int i = 0; i < kLevels; ++i)
    if (level == kNames[i]) return static_cast<CpuIsa>(i);
  TORCH_CHECK(false, "FASTATTN_CPU_ISA: unknown level '", level,
              "', expected amx, avx512, avx2 or scalar");
}

// The CPU's best, held lower by FASTATTN_CPU_ISA for the whole process; an unknown name is
// reported by fastattn's Python side when it loads the extension (a static initialiser cannot
// raise).
CpuIsa limit() {
  const CpuIsa best = detect();
  const char *env = std::getenv("FASTATTN_CPU_ISA");
  if (!env || !*env) return best;
  for (int i = 0; i < kLevels; ++i)
    if (std::string(env) == kNames[i]) return std::min(best, static_cast<CpuIsa>(i));
  return best;
}

std::atomic<int> level{static_cast<int>(limit())};

}  // namespace

CpuIsa supported_cpu_isa() {
  static const CpuIsa best = detect();
  return best;
}

CpuIsa cpu_isa_limit() {
  static const CpuIsa held = limit();
  return held;
}

CpuIsa cpu_isa() { return static_cast<CpuIsa>(level.load(std::memory_order_relaxed)); }

std::string cpu_isa_name(CpuIsa isa) { return kNames[static_cast<int>(isa)]; }

std::string set_cpu_isa(const std::string &name) {
  level.store(static_cast<int>(std::min(parse(name), cpu_isa_limit())));
  return cpu_isa_name(cpu_isa());
}

bool use_avx512_vnni() {
#ifdef FASTATTN_X86
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has && cpu_isa() >= CpuIsa::kAvx512;
#else
  return false;
#endif
}

bool use_avx512_bf16() {
#ifdef FASTATTN_X86
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has && cpu_isa() >= CpuIsa::kAvx512;
#else
  return false;
#endif
}

}  // namespace fastattn
