// Umbrella header: everything public in attn.
#pragma once

#include "attn/attention.hpp"
#include "attn/error.hpp"
#include "attn/kvcache.hpp"
#include "attn/nn.hpp"
#include "attn/tensor.hpp"
