// Umbrella header: every module of attn::nn and the safetensors I/O.
#pragma once

#include "attn/io/safetensors.hpp"
#include "attn/nn/layers.hpp"
#include "attn/nn/module.hpp"
#include "attn/nn/multihead_attention.hpp"
#include "attn/nn/positional.hpp"
#include "attn/nn/recurrent.hpp"
#include "attn/nn/rnn_attention.hpp"
#include "attn/nn/seq2seq.hpp"
#include "attn/nn/transformer.hpp"
