// e3-grpc-front's command line. No option carries a secret (the API key stays with the Python guard, which the
// front reaches on a private socket); e3.deploy.grpc_front_process writes every limit from its Python home.
#pragma once

#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "check.h"

namespace e3front {

inline const char* kUsage =
    "usage: e3-grpc-front --listen HOST:PORT --triton ADDRESS --guard ADDRESS [limits] | --check [limits]\n"
    "\n"
    "The public gRPC port of `e3 serve`: ModelInfer and ModelStreamInfer messages checked and forwarded to Triton,\n"
    "every other method forwarded to the Python gRPC guard. Control lines on stdin: `abort MODEL`, `stats`.\n"
    "\n"
    "  --listen HOST:PORT          where clients connect (port 0: any free port; the port is printed as\n"
    "                              `listening PORT` on stdout once it listens)\n"
    "  --triton ADDRESS            Triton's gRPC endpoint (unix:/path or host:port)\n"
    "  --guard ADDRESS             the Python gRPC guard (unix:/path or host:port)\n"
    "  --key-header NAME           the API key's header: never forwarded to Triton (also as triton-grpc-protocol-NAME)\n"
    "  --max-message-bytes N       largest message accepted (RESOURCE_EXHAUSTED above it)\n"
    "  --infer-threads N           threads serving ModelInfer, each on a completion queue of its own (default\n"
    "                              1: on a 2-core machine one thread, no hand-offs between threads, costs least)\n"
    "  --max-elements N            most elements one input's shape may declare\n"
    "  --max-dims N                most dimensions one shape may have\n"
    "  --model-name-pattern RE     a model name must match RE (ECMAScript syntax)\n"
    "  --datatype NAME=SIZE:KIND:LOW:HIGH\n"
    "                              a known datatype (repeat; order kept for messages): bytes per element (0:\n"
    "                              variable), kind bool|int|float|str, range of typed values\n"
    "  --reserved-parameter KEY=RULE\n"
    "                              a request parameter Triton reads (repeat): RULE bool|uint|id\n"
    "  --output-parameter KEY=RULE an output parameter Triton reads (repeat)\n"
    "  --check                     no server: read messages (4-byte little-endian length, then bytes) on stdin and\n"
    "                              write each verdict ('A' + the message to forward, or 'R' + the reason, each\n"
    "                              with its 4-byte length) on stdout\n"
    "  --help                      this text\n";

struct Options {
  std::string listen, triton, guard;
  std::set<std::string> key_names;   // lower-case metadata keys never forwarded to Triton
  int64_t max_message_bytes = 64 << 20;
  int infer_threads = 1;             // completion queues (one thread each) serving ModelInfer
  Limits limits;
  bool check = false, help = false;
};

inline bool SplitRule(const std::string& v, std::map<std::string, std::string>* into, std::string* error) {
  auto eq = v.find('=');
  std::string rule = eq == std::string::npos ? "" : v.substr(eq + 1);
  if (eq == std::string::npos || (rule != "bool" && rule != "uint" && rule != "id")) {
    *error = "a parameter rule is KEY=bool|uint|id, got '" + v + "'";
    return false;
  }
  (*into)[v.substr(0, eq)] = rule;
  return true;
}

inline bool ParseDatatype(const std::string& v, Datatype* d, std::string* error) {
  auto eq = v.find('=');
  std::vector<std::string> parts;
  for (size_t at = eq + 1; eq != std::string::npos;) {
    size_t colon = v.find(':', at);
    parts.push_back(v.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  if (eq == std::string::npos || parts.size() != 4 ||
      (parts[1] != "bool" && parts[1] != "int" && parts[1] != "float" && parts[1] != "str")) {
    *error = "--datatype is NAME=SIZE:KIND:LOW:HIGH (KIND bool|int|float|str), got '" + v + "'";
    return false;
  }
  d->name = v.substr(0, eq);
  d->size = std::strtoll(parts[0].c_str(), nullptr, 10);
  d->kind = parts[1] == "bool" ? 'b' : parts[1] == "int" ? 'i' : parts[1] == "float" ? 'f' : 's';
  d->low = std::strtold(parts[2].c_str(), nullptr);
  d->high = std::strtold(parts[3].c_str(), nullptr);
  return true;
}

inline bool ParseOptions(int argc, char** argv, Options* o, std::string* error) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") { o->help = true; return true; }
    if (a == "--check") { o->check = true; continue; }
    if (i + 1 >= argc) { *error = a + " needs a value, or is not an option"; return false; }
    std::string v = argv[++i];
    if (a == "--listen") o->listen = v;
    else if (a == "--triton") o->triton = v;
    else if (a == "--guard") o->guard = v;
    else if (a == "--key-header") {
      std::string k;
      for (char c : v) k += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      o->key_names.insert(k);
      o->key_names.insert("triton-grpc-protocol-" + k);
    } else if (a == "--max-message-bytes") o->max_message_bytes = std::strtoll(v.c_str(), nullptr, 10);
    else if (a == "--infer-threads") o->infer_threads = static_cast<int>(std::strtol(v.c_str(), nullptr, 10));
    else if (a == "--max-elements") o->limits.max_elements = std::strtoll(v.c_str(), nullptr, 10);
    else if (a == "--max-dims") o->limits.max_dims = std::strtoll(v.c_str(), nullptr, 10);
    else if (a == "--model-name-pattern") o->limits.model_name_pattern = v;
    else if (a == "--datatype") {
      Datatype d;
      if (!ParseDatatype(v, &d, error)) return false;
      o->limits.datatypes.push_back(d);
    } else if (a == "--reserved-parameter") { if (!SplitRule(v, &o->limits.reserved, error)) return false; }
    else if (a == "--output-parameter") { if (!SplitRule(v, &o->limits.output_rules, error)) return false; }
    else { *error = "unknown option " + a; return false; }
  }
  if (o->limits.max_elements <= 0 || o->limits.max_dims <= 0 || o->max_message_bytes <= 0 ||
      o->limits.datatypes.empty() || o->limits.model_name_pattern.empty()) {
    *error = "--max-elements, --max-dims, --max-message-bytes (all > 0), --model-name-pattern and at least one "
             "--datatype are required";
    return false;
  }
  if (o->infer_threads < 1 || o->infer_threads > 64) { *error = "--infer-threads must be 1..64"; return false; }
  if (o->limits.max_elements > (int64_t{1} << 62)) { *error = "--max-elements must be at most 2^62"; return false; }
  if (!o->check && (o->listen.empty() || o->triton.empty() || o->guard.empty())) {
    *error = "--listen, --triton and --guard are required (or --check)";
    return false;
  }
  try {
    o->limits.model_name = std::regex(o->limits.model_name_pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    *error = "--model-name-pattern is not a valid regular expression: " + std::string(e.what());
    return false;
  }
  return true;
}

}  // namespace e3front
