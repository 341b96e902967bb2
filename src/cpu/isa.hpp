// Which kernel computes bf16 attention: what the CPU reports, what the OS allows,
// and what the user forces with ATTN_ISA.
#pragma once

#include <cstddef>
#include <string>

namespace attn::detail {

/// The paths for bf16 inputs (and f32 inputs with Precision::bf16):
///   amx         the products on AMX tiles (tdpbf16ps), softmax in AVX-512;
///   avx512bf16  the same kernels with the products on vdpbf16ps (AMD Zen 4/5):
///               same packing, same softmax;
///   f32         the portable path: inputs widened to f32, the f32 kernel.
/// f16 inputs: one bf16 cannot hold an f16 value, two can (hi + lo, exactly), so on
/// amx f16 values enter the tiles as two bf16 pieces and each product takes three tile
/// products; on avx512bf16 those would cost more than the f32 kernel, so f16 takes
/// the f32 path there (and everywhere without AMX).
enum class LowpPath { amx, avx512bf16, f32 };

/// What this CPU and OS can run, detected once: AMX needs CPUID's AMX-TILE and
/// AMX-BF16, AVX-512 (Highway's AVX3 target) and Linux's permission for tile data
/// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), which is requested here;
/// a refusal makes amx unavailable, never an error.
struct CpuFeatures {
  bool amx_bf16 = false;     // CPUID and OS permission, usable
  bool amx_int8 = false;     // the same for AMX-INT8 (tdpbssd, tdpbusd)
  bool avx512_bf16 = false;  // CPUID
  bool avx512_vnni = false;  // CPUID (vpdpwssd, vpdpbusd on zmm)
  bool intel = false;        // CPUID's vendor is GenuineIntel
  /// vdpbf16ps computes at least the f32 FMA's flop rate: AMD's cores (Zen 5: twice
  /// it). Intel's do half of it (measured on Sapphire/Emerald Rapids cores with and
  /// without AMX in CPUID: docs/PERFORMANCE.md), so false where CPUID says GenuineIntel.
  bool bf16_dot_full_rate = false;
  std::string amx_refused;   // why amx is unusable when CPUID has it ("" otherwise)
};
const CpuFeatures& cpu_features();

/// The path a bf16 call takes now: ATTN_ISA (read on every call, so tests can switch
/// it) if set — "amx", "avx512bf16" or "f32"; throws attn::Error when it names an
/// unknown path or one this machine cannot run — else the fastest available: amx
/// where the tiles are usable; else avx512bf16 where vdpbf16ps runs at full rate
/// (AMD Zen 4/5); else f32. So Intel cores with AVX512-BF16 but no usable AMX (AMX
/// hidden by a hypervisor, refused by the OS, or absent as on Cooper Lake) take f32:
/// there vdpbf16ps has half the FMA's flop rate, and the f32 kernels, which widen
/// bf16 rows as they pack them (the forward) or copy them once (the backward), were
/// measured 1.2-1.7x faster (docs/PERFORMANCE.md).
LowpPath lowp_path();

/// Whether ATTN_ISA names the path (read on every call, as lowp_path() does): a forced
/// path runs every call, even one that another path would take faster.
bool lowp_path_forced();

/// Whether the decode kernel reads i8 caches with AMX-INT8 tiles: the CPU and OS
/// allow it and lowp_path() is amx (so ATTN_ISA=f32 forces the vector kernel).
bool decode_i8_on_tiles();

/// This core's L2 cache in bytes, as the C library reports it (sysconf), detected
/// once; 1 MiB when it reports nothing. The kernels size the key panels they keep in
/// L2 by it (2 MiB per core on the Intel Xeon with AMX, 1 MiB on Zen 4/5).
size_t l2_cache_bytes();

/// The last-level cache that this core shares, in bytes: Linux's sysfs entry for cpu0's
/// level-3 cache (the core complex's, 8 MiB on Zen 1), else the C library's figure
/// (which on Zen 1 reports the whole socket's 64 MiB), else 0; detected once.
size_t l3_cache_bytes();

/// "amx", "avx512bf16" or "f32".
const char* lowp_path_name(LowpPath path);

}  // namespace attn::detail
