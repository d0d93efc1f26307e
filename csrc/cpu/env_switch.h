// On/off switches of the CPU kernels read from the environment (once each, by their users), with
// the values flash_attn_ext.policy takes for FLASH_ATTN_EXT_STRICT.  Its own file: bf16_dot.cpp
// and fp16_convert.cpp include no library header with inline functions, and the error below
// needs c10's.
#pragma once

namespace flash_attn_ext::cpu {

// The environment variable `name` as a switch: 1, true, yes or on -> true; 0, false, no or off
// -> false (any case, surrounding spaces ignored); unset or empty -> `unset`.  Any other value
// raises c10::ValueError (ValueError in Python) naming the variable, its value and the accepted
// ones: a typo must not leave the switch at its default unnoticed.
bool env_switch(const char* name, bool unset);

}  // namespace flash_attn_ext::cpu
