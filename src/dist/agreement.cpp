#include "dist/agreement.hpp"

#include <algorithm>
#include <cstring>
#include <exception>

#include "tensor/convert.hpp"
#include "tensor/view_util.hpp"

namespace attn::dist::detail {
namespace {

// How a compared value is printed in the error message.
enum class Kind { integer, dtype, layout, real, scale, checksum };

// Shapes and options every rank must share, in the order they are compared.
struct Field {
  const char* name;
  Kind kind;
};
constexpr Field kFieldTable[] = {
    {"the batch size B (q dimension 0)", Kind::integer}, {"the query heads Hq", Kind::integer},
    {"the kv heads Hkv", Kind::integer},                 {"the head dimension d", Kind::integer},
    {"the value dimension dv", Kind::integer},           {"the dtype", Kind::dtype},
    {"the layout", Kind::layout},                        {"options.causal", Kind::integer},
    {"options.window.left", Kind::integer},              {"options.window.right", Kind::integer},
    {"options.scale", Kind::scale},                      {"options.softcap", Kind::real},
    {"options.dropout_p", Kind::real},                   {"options.seed", Kind::integer},
    {"options.offset", Kind::integer},                   {"options.precision", Kind::integer},
    {"options.alibi_slopes", Kind::checksum},            {"options.key_lengths", Kind::checksum}};
constexpr int kFields = sizeof(kFieldTable) / sizeof(kFieldTable[0]);

struct Summary {
  int32_t failed = 0;
  char message[400] = {};
  int64_t local_length = 0;
  int64_t field[kFields] = {};
};

// FNV-1a over a view's shape and its values as f32 (or int32) bits: equal
// tensors give equal sums on every rank; an absent tensor gives 0.
int64_t checksum(const TensorView& t) {
  if (t.empty()) return 0;
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t x) {
    for (int i = 0; i < 8; ++i) h = (h ^ ((x >> (8 * i)) & 0xff)) * 1099511628211ull;
  };
  for (int i = 0; i < t.rank(); ++i) mix(static_cast<uint64_t>(t.size(i)));
  mix(static_cast<uint64_t>(t.dtype()));
  if (t.data() == nullptr) return static_cast<int64_t>(h);
  ::attn::detail::for_each_element(t, [&](int64_t at, int64_t) {
    uint32_t bits = 0;
    const size_t es = dtype_size(t.dtype());
    std::memcpy(&bits, static_cast<const char*>(t.data()) + at * static_cast<int64_t>(es), std::min<size_t>(es, 4));
    mix(bits);
  });
  return static_cast<int64_t>(h);
}

int64_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::string field_value(Kind kind, int64_t x) {
  switch (kind) {
    case Kind::dtype: return dtype_name(static_cast<DType>(x));
    case Kind::layout: return x == static_cast<int64_t>(Layout::contiguous) ? "contiguous" : "zigzag";
    case Kind::checksum: return x == 0 ? "none" : "checksum " + std::to_string(x);
    case Kind::scale:
      if (x < 0) return "unset (1/sqrt(d))";
      [[fallthrough]];
    case Kind::real: {
      float f;
      const uint32_t u = static_cast<uint32_t>(x);
      std::memcpy(&f, &u, 4);
      return std::to_string(f);
    }
    case Kind::integer: break;
  }
  return std::to_string(x);
}

void fill_fields(Summary& s, const TensorView& q, const TensorView& k, const TensorView& v,
                 const AttentionOptions& o, Layout layout) {
  auto dim = [](const TensorView& t, int i) { return t.rank() > i ? t.size(i) : -1; };
  int64_t* f = s.field;
  f[0] = dim(q, 0), f[1] = dim(q, 2), f[2] = dim(k, 2), f[3] = dim(q, 3), f[4] = dim(v, 3);
  f[5] = static_cast<int64_t>(q.dtype()), f[6] = static_cast<int64_t>(layout);
  f[7] = static_cast<int64_t>(o.causal), f[8] = o.window.left, f[9] = o.window.right;
  f[10] = o.scale ? float_bits(*o.scale) : -1;
  f[11] = float_bits(o.softcap), f[12] = float_bits(o.dropout_p);
  f[13] = static_cast<int64_t>(o.seed), f[14] = static_cast<int64_t>(o.offset);
  f[15] = static_cast<int64_t>(o.precision);
  f[16] = checksum(o.alibi_slopes), f[17] = checksum(o.key_lengths);
  s.local_length = dim(q, 1);
}

// What every distributed entry point needs of its inputs before the shape checks of
// attention() itself.
void check_common(const char* fn, const TensorView& q, const TensorView& k, const TensorView& v,
                  const AttentionOptions& o) {
  auto fail = [fn](const std::string& what) { throw Error(std::string(fn) + ": " + what); };
  if (!o.mask.empty()) {
    fail("options.mask is not supported (an Lq × Lk mask defeats splitting the sequence); use causal, window, "
         "key_lengths or alibi_slopes");
  }
  if (!o.block_mask.empty()) {
    fail("options.block_mask is not supported (its blocks index one call's Lq × Lk plane); use causal, window, "
         "key_lengths or alibi_slopes");
  }
  if (!o.cu_seqlens_q.empty() || !o.cu_seqlens_k.empty()) {
    fail("packed sequences (options.cu_seqlens_q/k) are not supported; pass one [B, L_r, H, d] slice per rank");
  }
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    if (t->empty() || t->rank() != 4) {
      fail(std::string(name) + " must be [B, L_r, H, d] (rank 4), got " + (t->empty() ? "none" : t->describe()));
    }
  }
  if (k.size(1) != q.size(1) || v.size(1) != q.size(1)) {
    fail("k and v must hold the positions q holds (self-attention over one sequence): q " + q.describe() +
         ", k " + k.describe() + ", v " + v.describe());
  }
  if (!o.key_lengths.empty()) {
    const TensorView& t = o.key_lengths;
    if (t.dtype() != DType::i32 || t.rank() != 1 || t.size(0) != q.size(0)) {
      fail("options.key_lengths must be i32 [B] = [" + std::to_string(q.size(0)) + "], got " + t.describe());
    }
    if (t.size(0) > 0 && t.data() == nullptr) fail("options.key_lengths has a null data pointer");
  }
}

}  // namespace

std::vector<Segment> World::segments(int r) const {
  if (layout == Layout::zigzag) return shard_segments(length, r, ranks, layout);
  Segment s;
  for (int i = 0; i < r; ++i) s.position += local_lengths[static_cast<size_t>(i)];
  s.length = local_lengths[static_cast<size_t>(r)];
  if (s.length == 0) return {};
  return {s};
}

World agree(const char* fn, MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
            const AttentionOptions& options, Layout layout, const std::function<void()>& local_check) {
  World w;
  w.layout = layout;
  MPI_Comm_rank(comm, &w.rank);
  MPI_Comm_size(comm, &w.ranks);
  Summary mine;
  try {
    if (layout != Layout::contiguous && layout != Layout::zigzag) {
      throw Error(std::string(fn) + ": layout must be Layout::contiguous or Layout::zigzag");
    }
    check_common(fn, q, k, v, options);
    local_check();
    fill_fields(mine, q, k, v, options, layout);
  } catch (const std::exception& e) {
    mine.failed = 1;
    std::strncpy(mine.message, e.what(), sizeof(mine.message) - 1);
  }
  std::vector<Summary> all(static_cast<size_t>(w.ranks));
  MPI_Allgather(&mine, sizeof(Summary), MPI_BYTE, all.data(), sizeof(Summary), MPI_BYTE, comm);

  const std::string prefix = std::string(fn) + ": ";
  for (int r = 0; r < w.ranks; ++r) {
    const Summary& s = all[static_cast<size_t>(r)];
    if (!s.failed) continue;
    std::string msg = s.message;
    if (msg.rfind(prefix, 0) == 0) msg = msg.substr(prefix.size());
    throw Error(prefix + "rank " + std::to_string(r) + ": " + msg);
  }
  for (int r = 1; r < w.ranks; ++r) {
    for (int i = 0; i < kFields; ++i) {
      const int64_t a = all[0].field[i], b = all[static_cast<size_t>(r)].field[i];
      if (a != b) {
        const Field& f = kFieldTable[i];
        throw Error(prefix + "the ranks disagree on " + f.name + ": rank 0 has " + field_value(f.kind, a) + ", rank " +
                    std::to_string(r) + " has " + field_value(f.kind, b));
      }
    }
  }
  for (const Summary& s : all) {
    w.local_lengths.push_back(s.local_length);
    w.length += s.local_length;
  }
  if (layout == Layout::zigzag) {
    for (int r = 0; r < w.ranks; ++r) {
      const int64_t want = shard_length(w.length, r, w.ranks, layout);
      if (w.local_lengths[static_cast<size_t>(r)] != want) {
        throw Error(prefix + "with Layout::zigzag over " + std::to_string(w.ranks) + " ranks, rank " +
                    std::to_string(r) + " must hold " + std::to_string(want) + " of the " + std::to_string(w.length) +
                    " positions, got " + std::to_string(w.local_lengths[static_cast<size_t>(r)]) +
                    " (attn::dist::shard_length gives each rank's share)");
      }
    }
  }
  if (!options.key_lengths.empty()) {
    const TensorView& t = options.key_lengths;
    for (int64_t b = 0; b < t.size(0); ++b) {
      const int32_t x = t.data_as<const int32_t>()[b * t.stride(0)];
      if (x < 0 || x > w.length) {
        throw Error(prefix + "options.key_lengths[" + std::to_string(b) + "] must be in [0, " +
                    std::to_string(w.length) + "] (the whole sequence), got " + std::to_string(x));
      }
      w.key_lengths.push_back(x);
    }
  }
  return w;
}

}  // namespace attn::dist::detail
