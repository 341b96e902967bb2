// Checks AttentionOptions::block_mask and binds it into a Problem (one step of
// make_problem, kept apart because its checks read every block entry).
#pragma once

#include <cstdint>

#include "arg_checker.hpp"
#include "problem.hpp"

namespace attn::detail {

/// Validates `bm` for a call with B sequences, Hq query heads and the longest
/// sequences max_lq × max_lk (varlen: more blocks are accepted), then sets p's
/// bm_* fields. Throws attn::Error through `c` naming options.block_mask.
void bind_block_mask(const Checker& c, const BlockMask& bm, int B, int Hq, int64_t max_lq,
                     int64_t max_lk, bool varlen, Problem* p);

}  // namespace attn::detail
