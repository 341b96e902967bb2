// CPU feature detection for the bf16 kernels (see isa.hpp).
#include "cpu/isa.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <hwy/targets.h>

#include "attn/attention.hpp"
#include "attn/error.hpp"
#include "cpu/attention_forward.hpp"

#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#endif

namespace attn::detail {
namespace {

#if defined(__x86_64__)
bool cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (__get_cpuid_max(0, nullptr) < leaf) return false;
  __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
  return (r[reg] >> bit) & 1u;
}
constexpr int kEax = 0, kEbx = 1, kEcx = 2, kEdx = 3;

// CPUID leaf 0's vendor string is "GenuineIntel" on Intel's cores.
bool vendor_is_intel() {
  unsigned r[4] = {0, 0, 0, 0};
  __cpuid(0, r[kEax], r[kEbx], r[kEcx], r[kEdx]);
  char vendor[13] = {};
  std::memcpy(vendor, &r[kEbx], 4);
  std::memcpy(vendor + 4, &r[kEdx], 4);
  std::memcpy(vendor + 8, &r[kEcx], 4);
  return std::strcmp(vendor, "GenuineIntel") == 0;
}

// Linux keeps AMX's 8 KiB of tile state off until a process asks (kernel 5.16+).
std::string request_tile_permission() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    return std::string("the OS refused tile data (arch_prctl: ") + std::strerror(errno) + ")";
  }
  return "";
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__)
  const bool avx3 = (hwy::SupportedTargets() & (HWY_AVX3 | HWY_AVX3_DL)) != 0;
  const bool amx = cpuid_bit(7, 0, kEdx, 24) && cpuid_bit(7, 0, kEdx, 22);
  f.avx512_bf16 = avx3 && cpuid_bit(7, 1, kEax, 5);
  f.avx512_vnni = avx3 && cpuid_bit(7, 0, kEcx, 11);
  f.intel = vendor_is_intel();
  f.bf16_dot_full_rate = f.avx512_bf16 && !f.intel;
  if (amx) {
    f.amx_refused = avx3 ? request_tile_permission() : "no AVX-512";
    f.amx_bf16 = f.amx_refused.empty();
    f.amx_int8 = f.amx_bf16 && cpuid_bit(7, 0, kEdx, 25);
  }
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

LowpPath lowp_path() {
  const CpuFeatures& f = cpu_features();
  const char* env = std::getenv("ATTN_ISA");
  if (env == nullptr || *env == '\0') {
    if (f.amx_bf16) return LowpPath::amx;
    // An Intel core without usable AMX has vdpbf16ps at half the FMA rate: f32.
    if (f.bf16_dot_full_rate) return LowpPath::avx512bf16;
    return LowpPath::f32;
  }
  const std::string want = env;
  if (want == "f32") return LowpPath::f32;
  if (want == "avx512bf16") {
    if (f.avx512_bf16) return LowpPath::avx512bf16;
    throw Error("ATTN_ISA=avx512bf16, but this CPU has no AVX512-BF16 (or no AVX-512)");
  }
  if (want == "amx") {
    if (f.amx_bf16) return LowpPath::amx;
    throw Error("ATTN_ISA=amx, but this machine cannot run AMX: " +
                (f.amx_refused.empty() ? std::string("the CPU has no AMX-BF16") : f.amx_refused));
  }
  throw Error("ATTN_ISA must be amx, avx512bf16 or f32, got \"" + want + "\"");
}

bool lowp_path_forced() {
  const char* env = std::getenv("ATTN_ISA");
  return env != nullptr && *env != '\0';
}

size_t l2_cache_bytes() {
  static const size_t bytes = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)
    const long n = sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
    const long n = 0;
#endif
    return n > 0 ? static_cast<size_t>(n) : size_t{1} << 20;
  }();
  return bytes;
}

size_t l3_cache_bytes() {
  static const size_t bytes = [] {
    // "8192K": a number and a unit letter.
    if (std::FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
      unsigned long n = 0;
      char unit = 0;
      const int got = std::fscanf(f, "%lu%c", &n, &unit);
      std::fclose(f);
      if (got >= 1 && n > 0) {
        const size_t scale = unit == 'K' ? size_t{1} << 10 : unit == 'M' ? size_t{1} << 20 : unit == 'G' ? size_t{1} << 30 : 1;
        return static_cast<size_t>(n) * scale;
      }
    }
#if defined(_SC_LEVEL3_CACHE_SIZE)
    const long n = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (n > 0) return static_cast<size_t>(n);
#endif
    return size_t{0};
  }();
  return bytes;
}

bool decode_i8_on_tiles() { return cpu_features().amx_int8 && lowp_path() == LowpPath::amx; }

const char* lowp_path_name(LowpPath path) {
  switch (path) {
    case LowpPath::amx:
      return "amx";
    case LowpPath::avx512bf16:
      return "avx512bf16";
    case LowpPath::f32:
      break;
  }
  return "f32";
}

}  // namespace attn::detail

namespace attn {

CpuInfo cpu_info() {
  const detail::CpuFeatures& f = detail::cpu_features();
  CpuInfo info;
  info.simd_target = detail::attention_forward_target();
  info.amx_bf16 = f.amx_bf16;
  info.avx512_bf16 = f.avx512_bf16;
  info.amx_refused = f.amx_refused;
  info.bf16_path = detail::lowp_path_name(detail::lowp_path());
  return info;
}

}  // namespace attn
