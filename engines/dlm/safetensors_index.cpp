// model.safetensors.index.json: {"metadata": {...}, "weight_map": {"tensor name": "shard file"}}.
// Shard names must be plain file names inside the model directory.
#include <nlohmann/json.hpp>

#include "engine.h"

namespace sparsa::dlm {

Result<std::map<std::string, std::string>> parse_safetensors_index(const std::string& json_text,
                                                                   const std::string& where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    return Status(StatusCode::malformed_file, where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) return Status(StatusCode::malformed_file, where + ": expected a JSON object");
  if (!j.contains("weight_map")) return Status(StatusCode::malformed_file, where + ": 'weight_map' is missing");
  const auto& wm = j["weight_map"];
  if (!wm.is_object()) return Status(StatusCode::malformed_file, where + ": 'weight_map' must be an object");
  std::map<std::string, std::string> out;
  for (const auto& [name, file] : wm.items()) {
    if (!file.is_string()) {
      return Status(StatusCode::malformed_file,
                    where + ": 'weight_map' entry '" + name + "' must be a file name string");
    }
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos || f == "." || f == "..") {
      return Status(StatusCode::malformed_file, where + ": 'weight_map' entry '" + name + "' names '" + f +
                                                    "', expected a file name in the directory");
    }
    out[name] = f;
  }
  if (out.empty()) return Status(StatusCode::malformed_file, where + ": 'weight_map' is empty");
  return out;
}

}  // namespace sparsa::dlm
