// The compiled half of the Python package `attn` (module attn._attn): thin
// bindings from buffer-protocol objects (NumPy arrays, and PyTorch tensors through
// their NumPy views or DLPack capsules) and from DeviceTensors (CUDA memory) to attn's TensorViews,
// without copying, and the kernels run with the GIL released. The pure-Python half (python/attn/__init__.py) turns
// PyTorch's calling convention into these calls.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attn/attention.hpp"
#include "attn/kvcache.hpp"
#include "attn/error.hpp"

namespace py = pybind11;

namespace {

// A tensor in CUDA device memory, described by its owner (attn/_cuda.py builds one from
// a torch CUDA tensor: data_ptr, dtype, shape, strides, device index and the current
// stream). The host never reads through it; attn's CUDA path checks it like any view.
struct DeviceTensor {
  attn::TensorView view;
};

DeviceTensor make_device_tensor(uintptr_t ptr, const std::string& dtype, const std::vector<int64_t>& shape,
                                const std::vector<int64_t>& strides, int device, uintptr_t stream) {
  attn::DType dt;
  if (dtype == "float32") dt = attn::DType::f32;
  else if (dtype == "bfloat16") dt = attn::DType::bf16;
  else if (dtype == "float16") dt = attn::DType::f16;
  else if (dtype == "bool") dt = attn::DType::boolean;
  else if (dtype == "int32") dt = attn::DType::i32;
  else
    throw py::type_error("DeviceTensor: dtype must be float32, bfloat16, float16, bool or int32, got \"" + dtype + "\"");
  if (shape.size() != strides.size()) {
    throw py::value_error("DeviceTensor: shape has " + std::to_string(shape.size()) + " dimensions but strides " +
                          std::to_string(strides.size()));
  }
  if (shape.size() > attn::TensorView::kMaxRank) throw py::value_error("DeviceTensor: at most 8 dimensions are supported");
  if (device < 0) throw py::value_error("DeviceTensor: device must be a CUDA ordinal (>= 0), got " + std::to_string(device));
  for (int64_t st : strides) {
    if (st < 0) throw py::value_error("DeviceTensor: negative strides are not supported");
  }
  return {attn::TensorView(reinterpret_cast<void*>(ptr), dt, shape, strides)
              .on(attn::Device::cuda(device, reinterpret_cast<void*>(stream)))};
}

// DLPack's tensor, as torch.utils.dlpack.to_dlpack hands it over in a PyCapsule named
// "dltensor" (the first member of its DLManagedTensor). Declared here, not included:
// it is DLPack's stable ABI (dlpack.h, unchanged since v0.6), and these three
// structs are all attn reads of it. The capsule is read, not consumed: its owner
// frees the tensor when the capsule goes, after the call.
struct DLDevice {
  int32_t device_type;  // 1: kDLCPU
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 6 bool
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null: packed row-major
  uint64_t byte_offset;
};

attn::TensorView view_of_dlpack(const py::object& capsule, const char* name) {
  auto* t = static_cast<const DLTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (t == nullptr) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + ": expected an unused DLPack capsule (\"dltensor\")");
  }
  if (t->device.device_type != 1) throw py::value_error(std::string(name) + ": expected a CPU tensor");
  attn::DType dtype;
  const DLDataType d = t->dtype;
  if (d.lanes != 1) throw py::type_error(std::string(name) + ": vector element types are not supported");
  if (d.code == 2 && d.bits == 32) dtype = attn::DType::f32;
  else if (d.code == 2 && d.bits == 16) dtype = attn::DType::f16;
  else if (d.code == 4 && d.bits == 16) dtype = attn::DType::bf16;
  else if (d.code == 0 && d.bits == 32) dtype = attn::DType::i32;  // sequence lengths, block tables
  else
    throw py::type_error(std::string(name) + ": unsupported element type (DLPack code " + std::to_string(d.code) +
                         ", " + std::to_string(d.bits) + " bits); expected float32, float16 or bfloat16" +
                         " (int32 for sequence lengths and block tables)");
  if (t->ndim < 0 || t->ndim > attn::TensorView::kMaxRank)
    throw py::value_error(std::string(name) + ": at most 8 dimensions are supported");
  std::vector<int64_t> shape(t->shape, t->shape + t->ndim), strides(t->ndim);
  int64_t packed = 1;  // the stride of dimension i in a packed row-major tensor
  for (int i = t->ndim - 1; i >= 0; --i) {
    strides[i] = t->strides != nullptr ? t->strides[i] : packed;
    if (strides[i] < 0) throw py::value_error(std::string(name) + ": negative strides are not supported");
    packed *= shape[i];
  }
  return attn::TensorView(static_cast<const char*>(t->data) + t->byte_offset, dtype, shape, strides);
}

// A view of a buffer-protocol object: element type from its format, strides in
// elements. Never copies; rejects what the kernels cannot read in place.
attn::TensorView view_of(const py::object& obj, const char* name, bool writable, bool int16_is_bf16 = false) {
  if (obj.is_none()) return {};
  if (PyCapsule_CheckExact(obj.ptr())) return view_of_dlpack(obj, name);
  if (py::isinstance<DeviceTensor>(obj)) return obj.cast<const DeviceTensor&>().view;
  py::buffer buffer = py::reinterpret_borrow<py::buffer>(obj);
  py::buffer_info info;
  try {
    info = buffer.request(writable);
  } catch (const std::exception& e) {
    throw py::type_error(std::string(name) + ": expected an array supporting the buffer protocol" +
                         (writable ? " (writable)" : "") + ": " + e.what());
  }
  attn::DType dtype;
  const std::string& f = info.format;
  const bool int16 = (f == "h" || f == "H" || f == "<h" || f == "<H" || f == "=h" || f == "=H") && info.itemsize == 2;
  if (f == "f" && info.itemsize == 4) dtype = attn::DType::f32;
  else if ((f == "e" || f == "<e" || f == "=e") && info.itemsize == 2) dtype = attn::DType::f16;
  else if (int16 && int16_is_bf16) dtype = attn::DType::bf16;  // torch.bfloat16 seen as int16 (NumPy has no bf16)
  else if (f == "?" && info.itemsize == 1) dtype = attn::DType::boolean;
  else if ((f == "i" || f == "l" || f == "<i" || f == "=i") && info.itemsize == 4) dtype = attn::DType::i32;
  else if (f == "b" && info.itemsize == 1) dtype = attn::DType::i8;  // quantized KV caches
  else if (f == "B" && info.itemsize == 1) dtype = attn::DType::f8e4m3;  // E4M3 codes of fp8 KV caches
  else
    throw py::type_error(std::string(name) + ": unsupported element type (buffer format \"" + f + "\", " +
                         std::to_string(info.itemsize) + " bytes); expected float32, float16 or bfloat16" +
                         " (int32 for sequence lengths, bool or float32 for masks, int8 or uint8 E4M3 codes for quantized KV caches)");
  std::vector<int64_t> shape(info.shape.begin(), info.shape.end()), strides;
  for (py::ssize_t s : info.strides) {
    if (s < 0 || s % info.itemsize != 0)
      throw py::value_error(std::string(name) + ": negative or misaligned strides are not supported (stride " +
                            std::to_string(s) + " bytes); pass a copy made with numpy.ascontiguousarray");
    strides.push_back(s / info.itemsize);
  }
  if (shape.size() > attn::TensorView::kMaxRank)
    throw py::value_error(std::string(name) + ": at most 8 dimensions are supported");
  return attn::TensorView(info.ptr, dtype, shape, strides);
}

// The Python layer's causal code (attn._causal_code: 0 none, 1 top-left, 2 bottom-right).
attn::Causal causal_of(int code) {
  return code == 0 ? attn::Causal::None : code == 1 ? attn::Causal::TopLeft : attn::Causal::BottomRight;
}

attn::AttentionOptions make_options(std::optional<float> scale, int causal, int window_left, int window_right,
                                    const py::object& mask, const py::object& alibi_slopes, float softcap,
                                    const py::object& cu_seqlens_q, const py::object& cu_seqlens_k,
                                    const py::object& key_lengths, float dropout_p, uint64_t seed, uint64_t offset, bool bf16,
                                    int block_q, int block_k, const py::object& block_table,
                                    const py::object& block_tiles, int precision) {
  attn::AttentionOptions o;
  // 0, 1, 2: f32, bf16, bf16x3 (the Python layer checks the name; anything else is
  // left to the library's own check, which names "precision").
  o.precision = static_cast<attn::Precision>(precision);
  o.scale = scale;
  o.causal = causal_of(causal);
  o.window = {window_left, window_right};
  o.mask = view_of(mask, "attn_mask", false, bf16);
  o.alibi_slopes = view_of(alibi_slopes, "alibi_slopes", false);
  o.softcap = softcap;
  o.cu_seqlens_q = view_of(cu_seqlens_q, "cu_seqlens_q", false);
  o.cu_seqlens_k = view_of(cu_seqlens_k, "cu_seqlens_k", false);
  o.key_lengths = view_of(key_lengths, "key_lengths", false);
  o.dropout_p = dropout_p;
  o.seed = seed;
  o.offset = offset;
  o.block_mask.block_q = block_q;
  o.block_mask.block_k = block_k;
  o.block_mask.blocks = view_of(block_table, "block_mask.blocks", false);
  o.block_mask.tiles = view_of(block_tiles, "block_mask.tiles", false);
  return o;
}

// The same view with dimensions 1 and 2 exchanged: PyTorch's [B, H, L, d] as the
// kernels' [B, L, H, d], by strides alone (forward_heads_major).
attn::TensorView heads_major(const attn::TensorView& t) {
  if (t.empty() || t.rank() != 4) return t;  // the library's own checks name a wrong rank
  std::vector<int64_t> shape = t.shape(), strides = t.strides();
  std::swap(shape[1], shape[2]);
  std::swap(strides[1], strides[2]);
  return attn::TensorView(t.data(), t.dtype(), shape, strides);
}

attn::TensorView heads_major_view(const py::object& obj, const char* name, bool writable, bool bf16) {
  return heads_major(view_of(obj, name, writable, bf16));
}

// The options of the heads-major entries' calls: a mask, scale, causal code, precision.
attn::AttentionOptions lean_options(const py::object& mask, std::optional<float> scale, int causal, bool bf16,
                                    int precision) {
  attn::AttentionOptions o;
  o.precision = static_cast<attn::Precision>(precision);  // checked by the library
  o.scale = scale;
  o.causal = causal_of(causal);
  o.mask = view_of(mask, "attn_mask", false, bf16);
  return o;
}

}  // namespace

PYBIND11_MODULE(_attn, m) {
  m.doc() = "attn's fused attention kernels (use the `attn` package, not this module directly).";
  py::register_exception<attn::Error>(m, "Error", PyExc_ValueError);

  py::class_<DeviceTensor>(m, "DeviceTensor",
                           "A tensor in CUDA device memory (pointer, dtype, shape, strides in elements, device "
                           "index, cudaStream_t as an int), passed wherever the kernels take an array.")
      .def(py::init(&make_device_tensor), py::arg("ptr"), py::arg("dtype"), py::arg("shape"), py::arg("strides"),
           py::arg("device"), py::arg("stream") = 0)
      .def("__repr__", [](const DeviceTensor& t) { return "DeviceTensor(" + t.view.describe() + ")"; });

  m.def(
      "cuda_status",
      [](int device) {
        const attn::CudaStatus s = attn::cuda_status(device);
        py::dict d;
        d["built"] = s.built;
        d["unusable"] = s.unusable;
        return d;
      },
      py::arg("device") = 0, "Whether this build has the CUDA backend and why `device` cannot run it (\"\" if it can).");

  m.def(
      "forward",
      [](const py::object& q, const py::object& k, const py::object& v, const py::object& out,
         std::optional<float> scale, int causal, int window_left, int window_right, const py::object& mask,
         const py::object& alibi_slopes, float softcap, const py::object& cu_seqlens_q,
         const py::object& cu_seqlens_k, const py::object& key_lengths, float dropout_p, uint64_t seed,
         uint64_t offset, const py::object& lse, const py::object& probs, bool bf16, int block_q, int block_k,
         const py::object& block_table, const py::object& block_tiles, int precision, bool reference) {
        const attn::AttentionOptions o = make_options(scale, causal, window_left, window_right, mask, alibi_slopes,
                                                softcap, cu_seqlens_q, cu_seqlens_k, key_lengths, dropout_p,
                                                seed, offset, bf16, block_q, block_k, block_table, block_tiles,
                                                precision);
        const attn::TensorView qv = view_of(q, "query", false, bf16), kv = view_of(k, "key", false, bf16),
                               vv = view_of(v, "value", false, bf16), ov = view_of(out, "out", true, bf16),
                               lv = view_of(lse, "lse", true), pv = view_of(probs, "probs", true);
        py::gil_scoped_release release;  // the buffers stay alive: their owners are held by the caller
        if (reference) {
          attn::attention_reference(qv, kv, vv, ov, o, lv, pv);
        } else {
          attn::attention(qv, kv, vv, ov, o, lv, pv);
        }
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::kw_only(), py::arg("scale") = py::none(),
      py::arg("causal") = 0, py::arg("window_left") = -1, py::arg("window_right") = -1,
      py::arg("mask") = py::none(), py::arg("alibi_slopes") = py::none(), py::arg("softcap") = 0.0f,
      py::arg("cu_seqlens_q") = py::none(), py::arg("cu_seqlens_k") = py::none(),
      py::arg("key_lengths") = py::none(), py::arg("dropout_p") = 0.0f, py::arg("seed") = 0,
      py::arg("offset") = 0, py::arg("lse") = py::none(), py::arg("probs") = py::none(), py::arg("bf16") = false,
      py::arg("block_q") = 0, py::arg("block_k") = 0, py::arg("block_table") = py::none(),
      py::arg("block_tiles") = py::none(), py::arg("precision") = 0, py::arg("reference") = false,
      "Fused attention forward on BSHD views (or packed [total, H, d] with cu_seqlens); writes out, lse, probs. "
      "reference=True: the float64 reference instead (attn::attention_reference).");

  m.def(
      "forward_heads_major",
      [](const py::object& q, const py::object& k, const py::object& v, const py::object& out,
         const py::object& lse, const py::object& mask, std::optional<float> scale, int causal, bool bf16,
         int precision) {
        // The eager calls from PyTorch code with no option beyond these, at a fraction
        // of forward's cost for a short sequence: positional arguments only (pybind11
        // matches 25 keywords by name in ~4 µs) and PyTorch's layout taken as it is.
        const attn::AttentionOptions o = lean_options(mask, scale, causal, bf16, precision);
        const attn::TensorView qv = heads_major_view(q, "query", false, bf16),
                               kv = heads_major_view(k, "key", false, bf16),
                               vv = heads_major_view(v, "value", false, bf16),
                               ov = heads_major_view(out, "out", true, bf16), lv = view_of(lse, "lse", true);
        py::gil_scoped_release release;
        attn::attention(qv, kv, vv, ov, o, lv, {});
      },
      "forward on [B, H, L, d] views (out too; lse [B, H, L] or None), positional: (q, k, v, out, lse, mask, "
      "scale, causal, bf16, precision).");

  m.def(
      "backward_heads_major",
      [](const py::object& q, const py::object& k, const py::object& v, const py::object& out,
         const py::object& lse, const py::object& dout, const py::object& dq, const py::object& dk,
         const py::object& dv, const py::object& mask, std::optional<float> scale, int causal, bool bf16,
         int precision) {
        // forward_heads_major's backward, for the same eager calls when they want a
        // gradient: positional, and PyTorch's [B, H, L, d] taken as it is.
        const attn::AttentionOptions o = lean_options(mask, scale, causal, bf16, precision);
        const attn::TensorView qv = heads_major_view(q, "query", false, bf16),
                               kv = heads_major_view(k, "key", false, bf16),
                               vv = heads_major_view(v, "value", false, bf16),
                               ov = heads_major_view(out, "out", false, bf16), lv = view_of(lse, "lse", false),
                               gv = heads_major_view(dout, "grad_out", false, bf16),
                               dqv = heads_major_view(dq, "dq", true, bf16), dkv = heads_major_view(dk, "dk", true, bf16),
                               dvv = heads_major_view(dv, "dv", true, bf16);
        py::gil_scoped_release release;
        attn::attention_backward(qv, kv, vv, ov, lv, gv, dqv, dkv, dvv, o, {});
      },
      "backward on [B, H, L, d] views (lse [B, H, L]), positional: (q, k, v, out, lse, grad_out, dq, dk, dv, "
      "mask, scale, causal, bf16, precision).");

  m.def(
      "backward",
      [](const py::object& q, const py::object& k, const py::object& v, const py::object& out,
         const py::object& lse, const py::object& dout, const py::object& dq, const py::object& dk,
         const py::object& dv, std::optional<float> scale, int causal, int window_left, int window_right,
         const py::object& mask, const py::object& alibi_slopes, float softcap, const py::object& cu_seqlens_q,
         const py::object& cu_seqlens_k, const py::object& key_lengths, float dropout_p, uint64_t seed,
         uint64_t offset, const py::object& dbias, bool bf16, int block_q, int block_k, const py::object& block_table,
         const py::object& block_tiles, int precision, bool reference) {
        const attn::AttentionOptions o = make_options(scale, causal, window_left, window_right, mask, alibi_slopes,
                                                softcap, cu_seqlens_q, cu_seqlens_k, key_lengths, dropout_p,
                                                seed, offset, bf16, block_q, block_k, block_table, block_tiles,
                                                precision);
        const attn::TensorView qv = view_of(q, "query", false, bf16), kv = view_of(k, "key", false, bf16),
                               vv = view_of(v, "value", false, bf16), ov = view_of(out, "out", false, bf16),
                               lv = view_of(lse, "lse", false), gv = view_of(dout, "grad_out", false, bf16),
                               dqv = view_of(dq, "dq", true, bf16), dkv = view_of(dk, "dk", true, bf16),
                               dvv = view_of(dv, "dv", true, bf16), dbv = view_of(dbias, "dbias", true);
        py::gil_scoped_release release;
        if (reference) {
          attn::attention_backward_reference(qv, kv, vv, ov, lv, gv, dqv, dkv, dvv, o, dbv);
        } else {
          attn::attention_backward(qv, kv, vv, ov, lv, gv, dqv, dkv, dvv, o, dbv);
        }
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dout"), py::arg("dq"),
      py::arg("dk"), py::arg("dv"), py::kw_only(), py::arg("scale") = py::none(), py::arg("causal") = 0,
      py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("mask") = py::none(),
      py::arg("alibi_slopes") = py::none(), py::arg("softcap") = 0.0f, py::arg("cu_seqlens_q") = py::none(),
      py::arg("cu_seqlens_k") = py::none(), py::arg("key_lengths") = py::none(), py::arg("dropout_p") = 0.0f,
      py::arg("seed") = 0, py::arg("offset") = 0, py::arg("dbias") = py::none(), py::arg("bf16") = false,
      py::arg("block_q") = 0, py::arg("block_k") = 0, py::arg("block_table") = py::none(),
      py::arg("block_tiles") = py::none(), py::arg("precision") = 0, py::arg("reference") = false,
      "Gradients of forward (FlashAttention-2's backward); writes dq, dk, dv and optionally dbias. "
      "reference=True: the float64 reference instead (attn::attention_backward_reference).");

  m.def(
      "merge",
      [](const py::object& out_a, const py::object& lse_a, const py::object& out_b, const py::object& lse_b,
         const py::object& out, const py::object& lse, bool bf16) {
        const attn::TensorView oa = view_of(out_a, "out_a", false, bf16), la = view_of(lse_a, "lse_a", false),
                               ob = view_of(out_b, "out_b", false, bf16), lb = view_of(lse_b, "lse_b", false),
                               ov = view_of(out, "out", true, bf16), lv = view_of(lse, "lse", true);
        py::gil_scoped_release release;
        attn::merge_attention_states(oa, la, ob, lb, ov, lv);
      },
      py::arg("out_a"), py::arg("lse_a"), py::arg("out_b"), py::arg("lse_b"), py::arg("out"), py::kw_only(),
      py::arg("lse") = py::none(), py::arg("bf16") = false,
      "merge_attention_states on BSHD views: two partial attentions over disjoint keys into one.");

  m.def(
      "kvcache",
      [](const py::object& q, const py::object& k_cache, const py::object& v_cache, const py::object& k_scale,
         const py::object& v_scale, const py::object& block_table, const py::object& batch_idx,
         const py::object& cache_seqlens,
         const py::object& k_new, const py::object& v_new, const py::object& rotary_cos,
         const py::object& rotary_sin, bool rotary_interleaved, const py::object& out, const py::object& lse,
         std::optional<float> scale, int causal, int window_left, int window_right, float softcap,
         const py::object& alibi_slopes, const py::object& mask, int num_splits, bool q_bf16, bool cache_bf16,
         bool new_bf16, bool mask_bf16, int precision) {
        attn::KVCache cache;
        cache.k = view_of(k_cache, "k_cache", true, cache_bf16);
        cache.v = view_of(v_cache, "v_cache", true, cache_bf16);
        cache.k_scale = view_of(k_scale, "k_scale", true);
        cache.v_scale = view_of(v_scale, "v_scale", true);
        cache.block_table = view_of(block_table, "block_table", false);
        cache.batch_idx = view_of(batch_idx, "cache_batch_idx", false);
        attn::KVCacheOptions kv;
        kv.k_new = view_of(k_new, "k", false, new_bf16);
        kv.v_new = view_of(v_new, "v", false, new_bf16);
        kv.rotary_cos = view_of(rotary_cos, "rotary_cos", false);
        kv.rotary_sin = view_of(rotary_sin, "rotary_sin", false);
        kv.rotary_interleaved = rotary_interleaved;
        kv.num_splits = num_splits;
        const attn::TensorView sl = view_of(cache_seqlens, "cache_seqlens", false);
        if (q.is_none()) {
          py::gil_scoped_release release;
          attn::kvcache_append(cache, sl, kv);
          return;
        }
        attn::AttentionOptions o;
        o.scale = scale;
        o.causal = causal_of(causal);
        o.window = {window_left, window_right};
        o.softcap = softcap;
        o.alibi_slopes = view_of(alibi_slopes, "alibi_slopes", false);
        o.mask = view_of(mask, "attn_mask", false, mask_bf16);
        o.precision = static_cast<attn::Precision>(precision);  // checked by the library
        const attn::TensorView qv = view_of(q, "q", false, q_bf16), ov = view_of(out, "out", true, q_bf16),
                               lv = view_of(lse, "lse", true);
        py::gil_scoped_release release;
        attn::attention_with_kvcache(qv, cache, sl, ov, o, kv, lv);
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::kw_only(), py::arg("k_scale") = py::none(),
      py::arg("v_scale") = py::none(), py::arg("block_table") = py::none(), py::arg("batch_idx") = py::none(),
      py::arg("cache_seqlens"),
      py::arg("k") = py::none(), py::arg("v") = py::none(), py::arg("rotary_cos") = py::none(),
      py::arg("rotary_sin") = py::none(), py::arg("rotary_interleaved") = true, py::arg("out") = py::none(),
      py::arg("lse") = py::none(), py::arg("scale") = py::none(), py::arg("causal") = 0,
      py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("softcap") = 0.0f,
      py::arg("alibi_slopes") = py::none(), py::arg("mask") = py::none(), py::arg("num_splits") = 0,
      py::arg("q_bf16") = false, py::arg("cache_bf16") = false, py::arg("new_bf16") = false,
      py::arg("mask_bf16") = false, py::arg("precision") = 0,
      "attention_with_kvcache (q None: kvcache_append only) on FlashAttention's layouts; the cache is written "
      "in place.");

  m.def(
      "kvcache_lean",
      [](const py::object& q, const py::object& k_cache, const py::object& v_cache, const py::object& block_table,
         const py::object& cache_seqlens, const py::object& k_new, const py::object& v_new, const py::object& out,
         const py::object& lse, std::optional<float> scale, int causal, int num_splits, int precision,
         const py::object& rotary_cos, const py::object& rotary_sin, bool rotary_interleaved, int window_left,
         int window_right, float softcap) {
        // The decoding calls with no option beyond these, positional (pybind11 matches
        // kvcache's 27 keywords by name in several µs): float caches, no masks or ALiBi.
        // DLPack capsules carry their dtype, bf16 included.
        attn::KVCache cache;
        cache.k = view_of(k_cache, "k_cache", true);
        cache.v = view_of(v_cache, "v_cache", true);
        cache.block_table = view_of(block_table, "block_table", false);
        attn::KVCacheOptions kv;
        kv.k_new = view_of(k_new, "k", false);
        kv.v_new = view_of(v_new, "v", false);
        kv.rotary_cos = view_of(rotary_cos, "rotary_cos", false);
        kv.rotary_sin = view_of(rotary_sin, "rotary_sin", false);
        kv.rotary_interleaved = rotary_interleaved;
        kv.num_splits = num_splits;
        attn::AttentionOptions o;
        o.scale = scale;
        o.causal = causal_of(causal);
        o.window = {window_left, window_right};
        o.softcap = softcap;
        o.precision = static_cast<attn::Precision>(precision);  // checked by the library
        const attn::TensorView qv = view_of(q, "q", false), sl = view_of(cache_seqlens, "cache_seqlens", false),
                               ov = view_of(out, "out", true), lv = view_of(lse, "lse", true);
        py::gil_scoped_release release;
        attn::attention_with_kvcache(qv, cache, sl, ov, o, kv, lv);
      },
      "attention_with_kvcache without masks, ALiBi or quantized caches, positional: (q, k_cache, v_cache, "
      "block_table, cache_seqlens, k, v, out, lse, scale, causal, num_splits, precision, rotary_cos, rotary_sin, "
      "rotary_interleaved, window_left, window_right, softcap); block_table, k, v, lse and the rotary tables may "
      "be None.");

  m.def(
      "cpu_info",
      [] {
        const attn::CpuInfo c = attn::cpu_info();
        py::dict d;
        d["simd_target"] = c.simd_target;
        d["amx_bf16"] = c.amx_bf16;
        d["avx512_bf16"] = c.avx512_bf16;
        d["amx_refused"] = c.amx_refused;
        d["bf16_path"] = c.bf16_path;
        return d;
      },
      "What the CPU kernels use on this machine (see attn.cpu_info).");

  m.def("set_num_threads", &attn::set_num_threads, py::arg("n"),
        "Threads the kernels use (default: all cores, or ATTN_NUM_THREADS). Results do not depend on it.");
  m.def("num_threads", &attn::num_threads, "Threads the kernels use.");
}
