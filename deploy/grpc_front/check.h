// The gRPC front's checks of one ModelInferRequest: the same rules, in the same order and with the same
// messages, as e3.deploy.grpc_guard._check_infer (Python). The limits (model name pattern, datatypes,
// MAX_ELEMENTS, MAX_DIMS, Triton's reserved parameters) are not written here: e3 serve passes them on the
// command line from e3.deploy.request_check and e3.deploy.grpc_guard (Limits::FromArgs), so they have one
// home. tests/test_grpc_front.py runs both checkers over the gRPC fuzz corpus and compares their verdicts.
#pragma once

#include <cstdint>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "grpc_service.pb.h"

namespace e3front {

struct Datatype {
  std::string name;
  char kind = 's';          // 'b' bool, 'i' integer, 'f' floating point, 's' string (BYTES)
  long double low = 0, high = 0;
  int64_t size = 0;         // bytes per element; 0: variable (BYTES, length-prefixed elements)
};

struct Limits {
  int64_t max_elements = 0;                         // request_check.MAX_ELEMENTS
  int64_t max_dims = 0;                             // request_check.MAX_DIMS
  std::string model_name_pattern;                   // request_check.MODEL_NAME.pattern
  std::regex model_name;
  std::vector<Datatype> datatypes;                  // request_check.DATATYPES, in its order
  std::map<std::string, std::string> reserved;      // request_check.RESERVED_PARAMETERS: key -> bool|uint|id
  std::map<std::string, std::string> output_rules;  // grpc_guard.OUTPUT_PARAMETERS
  const Datatype* Find(const std::string& name) const;
};

// Checks `req` (parsed, as Triton parses it) in place; false and `error` naming the problem when refused. On
// true, unknown fields are gone and the message is what to forward.
bool CheckInfer(const Limits& limits, inference::ModelInferRequest* req, std::string* error);

// Python's spellings, so that both checkers' messages read alike: repr() of a str, str[:n], str() of a float.
std::string PyRepr(const std::string& utf8);
std::string PyPrefix(const std::string& utf8, size_t code_points);
std::string PyFloat(double x);

}  // namespace e3front
