// The checks of one ModelInferRequest (check.h): a line-by-line twin of e3.deploy.grpc_guard._check_infer.
#include "check.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cmath>
#include <cstring>

namespace e3front {
namespace {

using inference::InferParameter;

// One parameter's value as Python sees it (WhichOneof): none, bool, an integer (int64 or uint64), a double, a str.
struct Value {
  enum Kind { kNone, kBool, kInt, kDouble, kString } kind = kNone;
  bool b = false;
  __int128 i = 0;
  double d = 0;
  std::string s;
};

Value ValueOf(const InferParameter& p) {
  Value v;
  switch (p.parameter_choice_case()) {
    case InferParameter::kBoolParam: v.kind = Value::kBool; v.b = p.bool_param(); break;
    case InferParameter::kInt64Param: v.kind = Value::kInt; v.i = p.int64_param(); break;
    case InferParameter::kUint64Param: v.kind = Value::kInt; v.i = p.uint64_param(); break;
    case InferParameter::kDoubleParam: v.kind = Value::kDouble; v.d = p.double_param(); break;
    case InferParameter::kStringParam: v.kind = Value::kString; v.s = p.string_param(); break;
    default: break;
  }
  return v;
}

std::string Int(__int128 x) {
  if (x == 0) return "0";
  bool neg = x < 0;
  unsigned __int128 u = neg ? -static_cast<unsigned __int128>(x) : static_cast<unsigned __int128>(x);
  std::string out;
  while (u) { out.insert(out.begin(), static_cast<char>('0' + static_cast<int>(u % 10))); u /= 10; }
  return neg ? "-" + out : out;
}

std::string Str(const Value& v) {   // Python's str(value)
  switch (v.kind) {
    case Value::kBool: return v.b ? "True" : "False";
    case Value::kInt: return Int(v.i);
    case Value::kDouble: return PyFloat(v.d);
    case Value::kString: return v.s;
    default: return "None";
  }
}

bool Uint(const Value& v) { return v.kind == Value::kInt && v.i >= 0 && v.i < (static_cast<__int128>(1) << 64); }

// request_check.check_parameter
bool CheckParameter(const std::string& key, const Value& v, const std::map<std::string, std::string>& rules,
                    const std::string& what, std::string* error) {
  auto rule = rules.find(key);
  if (rule == rules.end()) return true;
  const std::string& r = rule->second;
  if (r == "bool" && v.kind == Value::kBool) return true;
  if ((r == "uint" || r == "id") && Uint(v)) return true;
  if (r == "id" && v.kind == Value::kString) return true;
  std::string want = r == "bool" ? "true or false" : r == "uint" ? "a non-negative integer"
                                                                  : "a non-negative integer or a string";
  *error = what + ": parameter " + PyRepr(key) + " must be " + want + ", got " + PyRepr(PyPrefix(Str(v), 30));
  return false;
}

template <typename Shape>
std::string ShapeText(const Shape& shape) {   // Python's str(list(t.shape))
  std::string out = "[";
  for (int k = 0; k < shape.size(); ++k) out += (k ? ", " : "") + Int(shape[k]);
  return out + "]";
}

uint32_t Le32(const std::string& s, size_t at) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data() + at);
  return p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// request_check._check_bytes_elements over a whole blob
bool CheckBytesElements(const std::string& blob, int64_t count, const std::string& what, std::string* error) {
  uint64_t at = 0, end = blob.size();
  int64_t seen = 0;
  while (at < end) {
    if (at + 4 > end) {
      *error = what + ": BYTES element " + Int(seen) + " has a truncated 4-byte length";
      return false;
    }
    uint32_t length = Le32(blob, at);
    at += 4 + static_cast<uint64_t>(length);
    seen += 1;
    if (at > end) {
      *error = what + ": BYTES element " + Int(seen - 1) + " of " + Int(length) + " bytes runs past its binary data";
      return false;
    }
    if (seen > count) break;
  }
  if (seen != count) {
    *error = what + ": the binary data holds " + (seen <= count ? Int(seen) : "more than " + Int(count)) +
             " BYTES elements, the shape says " + Int(count);
    return false;
  }
  return true;
}

// grpc_guard._CONTENTS: the InferTensorContents field that carries a datatype (Triton's protocol)
const char* ContentsField(const std::string& dt) {
  static const std::map<std::string, const char*> fields = {
      {"BOOL", "bool_contents"}, {"INT8", "int_contents"}, {"INT16", "int_contents"}, {"INT32", "int_contents"},
      {"INT64", "int64_contents"}, {"UINT8", "uint_contents"}, {"UINT16", "uint_contents"},
      {"UINT32", "uint_contents"}, {"UINT64", "uint64_contents"}, {"FP32", "fp32_contents"},
      {"FP64", "fp64_contents"}, {"BYTES", "bytes_contents"}};
  auto it = fields.find(dt);
  return it == fields.end() ? nullptr : it->second;
}

// (name, count) of every non-empty typed field, in grpc_guard._CONTENT_FIELDS' (sorted) order
std::vector<std::pair<std::string, int>> TypedFields(const inference::InferTensorContents& c) {
  std::vector<std::pair<std::string, int>> all = {
      {"bool_contents", c.bool_contents_size()}, {"bytes_contents", c.bytes_contents_size()},
      {"fp32_contents", c.fp32_contents_size()}, {"fp64_contents", c.fp64_contents_size()},
      {"int64_contents", c.int64_contents_size()}, {"int_contents", c.int_contents_size()},
      {"uint64_contents", c.uint64_contents_size()}, {"uint_contents", c.uint_contents_size()}};
  std::vector<std::pair<std::string, int>> out;
  for (auto& f : all) if (f.second) out.push_back(f);
  return out;
}

// grpc_guard._check_values: typed contents finite and within the datatype's range
template <typename Values>
bool CheckRange(const Values& values, const Datatype& dt, bool floating, const std::string& what, std::string* error) {
  for (const auto& x : values) {
    bool bad;
    if (floating) {   // as numpy compares: the value and the bounds as float64
      double v = static_cast<double>(x);
      bad = !std::isfinite(v) || v < static_cast<double>(dt.low) || v > static_cast<double>(dt.high);
    } else {
      long double v = static_cast<long double>(x);
      bad = v < dt.low || v > dt.high;
    }
    if (bad) {
      std::string text = floating ? PyFloat(static_cast<double>(x)) : Int(static_cast<__int128>(x));
      *error = what + ": " + text + " in contents is not a valid " + dt.name + " value";
      return false;
    }
  }
  return true;
}

bool CheckValues(const inference::InferTensorContents& c, const Datatype& dt, const std::string& what,
                 std::string* error) {
  if (dt.kind == 'f') {
    return dt.name == "FP32" ? CheckRange(c.fp32_contents(), dt, true, what, error)
                             : CheckRange(c.fp64_contents(), dt, true, what, error);
  }
  if (dt.name == "INT8" || dt.name == "INT16") return CheckRange(c.int_contents(), dt, false, what, error);
  if (dt.name == "UINT8" || dt.name == "UINT16") return CheckRange(c.uint_contents(), dt, false, what, error);
  return true;   // wider integers fill their field's own type; BOOL and BYTES have no range
}

// A parameter map in key order (protobuf's maps iterate in no set order): the first problem reported is the one
// the Python guard, which sorts too, reports.
std::map<std::string, const InferParameter*> Sorted(const google::protobuf::Map<std::string, InferParameter>& m) {
  std::map<std::string, const InferParameter*> out;
  for (const auto& kv : m) out.emplace(kv.first, &kv.second);
  return out;
}

bool Fail(std::string* error, std::string message) {
  *error = std::move(message);
  return false;
}

}  // namespace

const Datatype* Limits::Find(const std::string& name) const {
  for (const auto& d : datatypes) if (d.name == name) return &d;
  return nullptr;
}

bool NameAllowed(const Limits& L, const std::string& name) {
  // libstdc++'s regex costs microseconds a call: the last name this thread accepted is remembered
  thread_local std::string last_ok;
  thread_local const Limits* last_limits = nullptr;
  if (last_limits == &L && name == last_ok && !name.empty()) return true;
  if (!std::regex_match(name, L.model_name)) return false;
  last_ok = name;
  last_limits = &L;
  return true;
}

bool CheckInfer(const Limits& L, inference::ModelInferRequest* req, std::string* error) {
  if (!NameAllowed(L, req->model_name()))
    return Fail(error, "model name " + PyRepr(PyPrefix(req->model_name(), 60)) +
                       " is not allowed (letters, digits, '_', '-', '.')");
  const std::string& version = req->model_version();
  if (!version.empty()) {
    bool digits = version.size() <= 18;
    for (char ch : version) digits = digits && ch >= '0' && ch <= '9';
    if (!digits) return Fail(error, "model version " + PyRepr(PyPrefix(version, 20)) + " is not a decimal number");
  }
  for (const auto& [key, p] : Sorted(req->parameters())) {
    Value v = ValueOf(*p);
    if (v.kind == Value::kDouble && !std::isfinite(v.d))
      return Fail(error, "parameter " + PyRepr(PyPrefix(key, 40)) + " is not a finite number");
    if (!CheckParameter(key, v, L.reserved, "the request", error)) return false;
  }
  if (req->inputs_size() == 0) return Fail(error, "the request needs at least one input");
  const int raw_n = req->raw_input_contents_size();
  std::vector<bool> uses_raw;
  int raw_inputs = 0;
  for (const auto& t : req->inputs()) {
    bool shm = false;
    for (const auto& kv : t.parameters()) shm = shm || kv.first.rfind("shared_memory", 0) == 0;
    uses_raw.push_back(!shm);
    raw_inputs += !shm;
  }
  if (raw_n && raw_n != raw_inputs)
    return Fail(error, "raw_input_contents has " + Int(raw_n) + " entries for " + Int(raw_inputs) +
                       " inputs not in shared memory (one per such input, in order)");
  int at = 0;
  for (int i = 0; i < req->inputs_size(); ++i) {
    const auto& t = req->inputs(i);
    if (t.name().empty()) return Fail(error, "input " + Int(i) + " needs a name");
    const std::string what = "input " + PyRepr(PyPrefix(t.name(), 40));
    const Datatype* dt = L.Find(t.datatype());
    if (dt == nullptr) {
      std::string names;
      for (const auto& d : L.datatypes) names += (names.empty() ? "" : ", ") + d.name;
      return Fail(error, what + ": datatype " + PyRepr(PyPrefix(t.datatype(), 20)) + " is not one of " + names);
    }
    // request_check._shape: refused at the first dimension that is negative or takes the count past the limit
    if (t.shape_size() > L.max_dims)
      return Fail(error, what + ": shape has " + Int(t.shape_size()) + " dimensions, more than the " +
                         Int(L.max_dims) + " allowed");
    __int128 count = 1;
    for (int k = 0; k < t.shape_size(); ++k) {
      int64_t d = t.shape(k);
      if (d < 0)
        return Fail(error, what + ": shape dimension " + Int(k) + " is " + PyPrefix(Int(d), 24) +
                           ", not a non-negative integer");
      if (d > L.max_elements || count * d > L.max_elements)
        return Fail(error, what + ": shape dimension " + Int(k) + " (" + Int(d) + ") takes the element count past "
                           "the " + Int(L.max_elements) + " allowed");
      count *= d;
    }
    for (const auto& [key, p] : Sorted(t.parameters())) {
      if (key.rfind("shared_memory_", 0) == 0 && key != "shared_memory_region" && !Uint(ValueOf(*p)))
        return Fail(error, what + ": " + key + " must be a non-negative integer");
    }
    auto typed = TypedFields(t.contents());
    const int64_t size = dt->size;
    if (!uses_raw[i]) {
      if (!typed.empty()) return Fail(error, what + ": give shared memory or contents, not both");
      auto n = t.parameters().find("shared_memory_byte_size");
      if (n == t.parameters().end() || (size && ValueOf(n->second).i != count * size))
        return Fail(error, what + ": shared_memory_byte_size must be the shape's " + Int(count) + " elements of " +
                           t.datatype());
      continue;
    }
    if (raw_n) {
      if (!typed.empty()) return Fail(error, what + ": give raw_input_contents or contents, not both");
      const std::string& blob = req->raw_input_contents(at++);
      if (size && static_cast<__int128>(blob.size()) != count * size)
        return Fail(error, what + ": raw contents of " + Int(blob.size()) + " bytes, shape " + ShapeText(t.shape()) +
                           " of " + t.datatype() + " needs " + Int(count * size));
      if (!size && !CheckBytesElements(blob, static_cast<int64_t>(count), what, error)) return false;
      continue;
    }
    const char* want = ContentsField(t.datatype());
    if (want == nullptr)
      return Fail(error, what + ": " + t.datatype() + " has no typed contents field; send it in raw_input_contents");
    if (count && (typed.size() != 1 || typed[0].first != want)) {
      std::string got;
      for (auto& f : typed) got += (got.empty() ? "" : ", ") + f.first;
      return Fail(error, what + ": " + t.datatype() + " data goes in contents." + want + " (got " +
                         (got.empty() ? "none" : got) + ")");
    }
    int n = 0;
    for (auto& f : typed) if (f.first == want) n = f.second;
    if (n != count)
      return Fail(error, what + ": shape " + ShapeText(t.shape()) + " holds " + Int(count) + " elements, contents has " +
                         Int(n));
    if (!CheckValues(t.contents(), *dt, what, error)) return false;
  }
  for (int j = 0; j < req->outputs_size(); ++j) {
    const auto& o = req->outputs(j);
    if (o.name().empty()) return Fail(error, "output " + Int(j) + " needs a name");
    for (const auto& [key, p] : Sorted(o.parameters()))
      if (!CheckParameter(key, ValueOf(*p), L.output_rules, "output " + PyRepr(PyPrefix(o.name(), 40)), error))
        return false;
  }
  req->DiscardUnknownFields();
  return true;
}

// -- Python's spellings -------------------------------------------------------------------------------------

namespace {
// UTF-8 (valid: proto3 strings are checked by the parser) to code points
std::vector<uint32_t> CodePoints(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    unsigned char c = s[i];
    int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
    for (int k = 1; k < n && i + k < s.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += n;
  }
  return out;
}

std::string Utf8(uint32_t cp) {
  std::string o;
  if (cp < 0x80) { o += static_cast<char>(cp); }
  else if (cp < 0x800) { o += static_cast<char>(0xC0 | (cp >> 6)); o += static_cast<char>(0x80 | (cp & 0x3F)); }
  else if (cp < 0x10000) {
    o += static_cast<char>(0xE0 | (cp >> 12)); o += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    o += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    o += static_cast<char>(0xF0 | (cp >> 18)); o += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    o += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)); o += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return o;
}

// str.isprintable(), for the code points a message is likely to hold (controls, separators, format characters,
// private use); exotic unassigned code points may differ from Python's table: only the message's spelling
bool Printable(uint32_t cp) {
  if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) return false;
  if ((cp >= 0x200B && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202E) || (cp >= 0x2060 && cp <= 0x206F)) return false;
  if (cp == 0xFEFF || (cp >= 0xFFF9 && cp <= 0xFFFB) || cp == 0xFFFE || cp == 0xFFFF) return false;
  if ((cp >= 0xE000 && cp <= 0xF8FF) || cp >= 0xF0000 || (cp >= 0xE0000 && cp <= 0xE007F)) return false;
  if (cp >= 0x323B0 && cp <= 0xDFFFF) return false;   // planes 3 (past CJK extension H) to 13: unassigned
  return true;
}
}  // namespace

std::string PyPrefix(const std::string& s, size_t n) {
  size_t i = 0, seen = 0;
  while (i < s.size() && seen < n) {
    unsigned char c = s[i];
    i += c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    ++seen;
  }
  return s.substr(0, std::min(i, s.size()));
}

std::string PyRepr(const std::string& s) {
  char quote = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
  std::string out(1, quote);
  char buf[16];
  for (uint32_t cp : CodePoints(s)) {
    if (cp == static_cast<uint32_t>(quote) || cp == '\\') { out += '\\'; out += static_cast<char>(cp); }
    else if (cp == '\t') out += "\\t";
    else if (cp == '\n') out += "\\n";
    else if (cp == '\r') out += "\\r";
    else if (Printable(cp)) out += Utf8(cp);
    else {
      std::snprintf(buf, sizeof buf, cp < 0x100 ? "\\x%02x" : cp < 0x10000 ? "\\u%04x" : "\\U%08x", cp);
      out += buf;
    }
  }
  return out + quote;
}

std::string PyFloat(double x) {   // repr(float): shortest round-trip digits, Python's choice of notation
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, std::fabs(x), std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  size_t e = sci.find('e');
  std::string digits;
  for (size_t k = 0; k < e; ++k) if (sci[k] != '.') digits += sci[k];
  int decpt = std::stoi(sci.substr(e + 1)) + 1;
  std::string out = std::signbit(x) ? "-" : "";
  if (decpt <= -4 || decpt > 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    int exp = decpt - 1;
    std::snprintf(buf, sizeof buf, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    return out + buf;
  }
  if (decpt <= 0) return out + "0." + std::string(-decpt, '0') + digits;
  if (decpt >= static_cast<int>(digits.size())) return out + digits + std::string(decpt - digits.size(), '0') + ".0";
  return out + digits.substr(0, decpt) + "." + digits.substr(decpt);
}

}  // namespace e3front
