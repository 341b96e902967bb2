// The reference attention backward: gradients of reference_forward, derived by
// hand and written per element, each line citing the forward line it
// differentiates (as llm.c does). The oracle for the fused backward.
#pragma once

#include "../problem.hpp"

namespace attn::detail {

/// Gradients of p.fwd's forward in precision T, recomputing the forward from q,
/// k, v (p.fwd.out and p.fwd.lse are not read). dq, dk, dv (and dbias if
/// p.dbias) are T buffers laid out like the views, zeroed here and accumulated.
template <class T>
void reference_backward(const BackwardProblem& p, T* dq, T* dk, T* dv, T* dbias,
                        size_t dq_span, size_t dk_span, size_t dv_span, size_t dbias_span);

}  // namespace attn::detail
