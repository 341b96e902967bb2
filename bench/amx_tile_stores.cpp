// amx_tile_stores: what the score stores cost the tile unit in the bf16 forward's
// S = Q·Kᵀ (issue 11, d = 64), measured on its own. 32 queries × 2048 keys, d = 64:
// K in the kernel's packed layout, streamed from L2 (256 KiB) as the kernel does for
// each query block; S is [32][256] f32, the kernel's score buffer. Each row is one
// way of issuing the same 512 tdpbf16ps:
//   kernel 2x2     the forward's schedule (TileProducts2x2): per 32 keys and d chunk,
//                  load 2 Q and 2 K tiles, 4 products; store the 4 score tiles
//   no stores      the same, storing only every 8th key pair (wrong S: cost only)
//   K from L1      the same, every K load reading one 2 KiB group (wrong S: cost only)
//   K streamed     the kernel's schedule with K loaded by TILELOADDT1 (no L1 fill)
//   Q kept         Q's 4 tiles loaded once, 2 K tiles and 2 stores per 16 keys
//   Q kept, K str. the same with TILELOADDT1
// Rates are GFLOP/s of the products (2·32·2048·64 per pass), median of 200 passes, at
// the TSC frequency the bench measures; compare with bench/peak's AMX figure.
//
// usage: amx_tile_stores   (CPUs with AMX-BF16 only; one thread)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "timing.hpp"

#define AMX_FN __attribute__((target("amx-tile,amx-bf16"), noinline))

namespace {

using bf16 = uint16_t;
constexpr int kD = 64, kChunks = kD / 32, kKeys = 2048, kW = 256;

struct Data {
  alignas(64) bf16 q[32 * kD];     // rows of d
  alignas(64) float s[32 * kW];    // the score buffer, row stride kW
  bf16* k = nullptr;               // [group of 16 keys][d chunk][16][32]
};

const bf16* Group(const Data& x, int g) { return x.k + static_cast<size_t>(g) * kChunks * 512; }

AMX_FN void Configure() {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;
  for (int t = 0; t < 8; ++t) cfg[16 + 2 * t] = 64, cfg[48 + t] = 16;
  __asm__ volatile("" : : "r"(cfg) : "memory");  // GCC 12 drops the stores otherwise
  _tile_loadconfig(cfg);
}

/// The kernel's 2×2 schedule over one block of kW keys from key k0.
/// store_every: store the score tiles of every n-th key pair; fixed_k: read group 0.
template <bool kStream>
AMX_FN void Kernel2x2(Data& x, int k0, int store_every, bool fixed_k) {
  for (int kp = 0; kp < kW / 32; ++kp) {
    const int g = fixed_k ? 0 : k0 / 16 + 2 * kp;
    const bf16* b0 = Group(x, g);
    const bf16* b1 = Group(x, fixed_k ? 0 : g + 1);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int j = 0; j < kChunks; ++j) {
      _tile_loadd(4, x.q + j * 32, kD * 2);
      _tile_loadd(5, x.q + 16 * kD + j * 32, kD * 2);
      if (kStream) {
        _tile_stream_loadd(6, b0 + j * 512, 64);
        _tile_stream_loadd(7, b1 + j * 512, 64);
      } else {
        _tile_loadd(6, b0 + j * 512, 64);
        _tile_loadd(7, b1 + j * 512, 64);
      }
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    if (kp % store_every == store_every - 1) {
      float* s0 = x.s + kp * 32;
      _tile_stored(0, s0, kW * 4); _tile_stored(1, s0 + 16, kW * 4);
      _tile_stored(2, s0 + 16 * kW, kW * 4); _tile_stored(3, s0 + 16 * kW + 16, kW * 4);
    }
  }
}

/// Q's four tiles (2 row blocks × 2 d chunks) stay loaded; per 16 keys, 2 K tiles,
/// 4 products into 2 accumulators, 2 stores.
template <bool kStream>
AMX_FN void QKept(Data& x, int k0) {
  _tile_loadd(4, x.q, kD * 2); _tile_loadd(5, x.q + 32, kD * 2);
  _tile_loadd(6, x.q + 16 * kD, kD * 2); _tile_loadd(7, x.q + 16 * kD + 32, kD * 2);
  for (int g = 0; g < kW / 16; ++g) {
    const bf16* b = Group(x, k0 / 16 + g);
    if (kStream) {
      _tile_stream_loadd(2, b, 64); _tile_stream_loadd(3, b + 512, 64);
    } else {
      _tile_loadd(2, b, 64); _tile_loadd(3, b + 512, 64);
    }
    _tile_zero(0); _tile_zero(1);
    _tile_dpbf16ps(0, 4, 2); _tile_dpbf16ps(1, 6, 2); _tile_dpbf16ps(0, 5, 3); _tile_dpbf16ps(1, 7, 3);
    _tile_stored(0, x.s + g * 16, kW * 4); _tile_stored(1, x.s + 16 * kW + g * 16, kW * 4);
  }
}

AMX_FN void Release() { _tile_release(); }

bool CpuHasAmxBf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16, AMX-TILE
}

}  // namespace

int main() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (!CpuHasAmxBf16() || syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::printf("amx_tile_stores: this CPU (or OS) offers no AMX-BF16 tiles\n");
    return 0;
  }
  Data x;
  x.k = static_cast<bf16*>(std::aligned_alloc(64, sizeof(bf16) * kKeys * kD));
  std::srand(1);
  // Random bf16 values in [1, 2): finite, never constant.
  for (size_t i = 0; i < static_cast<size_t>(kKeys) * kD; ++i) x.k[i] = static_cast<bf16>(0x3F80 + (std::rand() & 0x7F));
  for (int i = 0; i < 32 * kD; ++i) x.q[i] = static_cast<bf16>(0x3F80 + (std::rand() & 0x7F));
  // TSC ticks per second, to turn rdtsc counts into rates.
  const double t0 = attn::bench::now_s();
  const unsigned long long c0 = __rdtsc();
  while (attn::bench::now_s() - t0 < 0.2) {
  }
  const double tsc_hz = static_cast<double>(__rdtsc() - c0) / (attn::bench::now_s() - t0);

  Configure();
  struct Row {
    const char* name;
    void (*run)(Data&, int);
  };
  const Row rows[] = {
      {"kernel 2x2", [](Data& d, int k0) { Kernel2x2<false>(d, k0, 1, false); }},
      {"no stores", [](Data& d, int k0) { Kernel2x2<false>(d, k0, 8, false); }},
      {"K from L1", [](Data& d, int k0) { Kernel2x2<false>(d, k0, 1, true); }},
      {"K streamed", [](Data& d, int k0) { Kernel2x2<true>(d, k0, 1, false); }},
      {"Q kept", [](Data& d, int k0) { QKept<false>(d, k0); }},
      {"Q kept, K streamed", [](Data& d, int k0) { QKept<true>(d, k0); }},
  };
  std::printf("S = Q.K^T, 32 queries x %d keys, d = %d, bf16 tiles; TSC %.2f GHz\n", kKeys, kD, tsc_hz / 1e9);
  for (const Row& r : rows) {
    std::vector<double> ticks;
    for (int rep = 0; rep < 200; ++rep) {
      const unsigned long long c = __rdtsc();
      for (int k0 = 0; k0 < kKeys; k0 += kW) r.run(x, k0);
      ticks.push_back(static_cast<double>(__rdtsc() - c));
    }
    const double s = attn::bench::median(ticks) / tsc_hz;
    std::printf("  %-20s %8.0f GFLOP/s\n", r.name, 2.0 * 32 * kKeys * kD / s / 1e9);
  }
  Release();
  std::free(x.k);
  return 0;
}
