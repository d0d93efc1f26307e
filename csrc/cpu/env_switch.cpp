#include "cpu/env_switch.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

namespace flash_attn_ext::cpu {

bool env_switch(const char* name, bool unset) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return unset;
  std::string value(raw);
  const auto space = [](unsigned char c) { return std::isspace(c) != 0; };
  value.erase(value.begin(), std::find_if_not(value.begin(), value.end(), space));
  value.erase(std::find_if_not(value.rbegin(), value.rend(), space).base(), value.end());
  std::transform(value.begin(), value.end(), value.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (value.empty()) return unset;
  const bool on = value == "1" || value == "true" || value == "yes" || value == "on";
  const bool off = value == "0" || value == "false" || value == "no" || value == "off";
  TORCH_CHECK_VALUE(on || off, name, " must be 1, true, yes or on, or 0, false, no or off (unset: ",
                    unset ? "on" : "off", "), got '", raw, "'");
  return on;
}

}  // namespace flash_attn_ext::cpu
