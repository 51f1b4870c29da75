// What the front's call handlers share (front.cc: the server, streams and other methods; infer.cc: ModelInfer).
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/proto_utils.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "check.h"
#include "options.h"

namespace e3front {

using grpc::ByteBuffer;
using grpc::Status;
using grpc::StatusCode;
using inference::ModelInferRequest;

// A call that abort() may end (a ModelInfer call in flight to Triton).
struct Abortable {
  virtual void Abort() = 0;   // under Front::mu
  virtual ~Abortable() = default;
};

const std::string kService = "/inference.GRPCInferenceService/";

// What every call shares: the options, the two upstream stubs, the calls in flight, the counters.
struct Front {
  Options opt;
  std::unique_ptr<grpc::GenericStub> triton, guard;
  std::mutex mu;
  std::unordered_map<std::string, std::unordered_set<Abortable*>> inflight;   // model -> ModelInfer calls in flight
  std::atomic<uint64_t> codes[17] = {};
  std::atomic<uint64_t> bad{0};
  std::atomic<int64_t> last_log_s{-1000}, quiet{0};

  void Count(StatusCode code) { codes[static_cast<int>(code) & 15]++; }
  // A refused message: counted, and logged at most once per 10 s (as the Python guard's BadRequestLog).
  void Refused(const std::string& message) {
    bad++;
    int64_t now = std::chrono::duration_cast<std::chrono::seconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
    int64_t last = last_log_s.load();
    if (now - last < 10 || !last_log_s.compare_exchange_strong(last, now)) { quiet++; return; }
    int64_t more = quiet.exchange(0);
    std::string tail = more ? " (and " + std::to_string(more) + " more since the last line)" : "";
    std::fprintf(stderr, "e3-grpc-front: refused a request (INVALID_ARGUMENT): %s%s\n",
                 message.substr(0, 200).c_str(), tail.c_str());
  }
};

inline bool Parse(ByteBuffer* in, ModelInferRequest* req) {
  return grpc::GenericDeserialize<grpc::ProtoBufferReader, ModelInferRequest>(in, req).ok();
}

inline ByteBuffer Serialise(const google::protobuf::Message& m) {
  ByteBuffer out;
  bool own;
  grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(m, &out, &own);
  return out;
}

// The client's metadata for the next hop (not gRPC's own; toward Triton, not the key's header either) and its
// deadline.
inline void Carry(const Front& f, const grpc::ServerContextBase* from, grpc::ClientContext* to, bool to_triton) {
  for (const auto& [k, v] : from->client_metadata()) {
    std::string key(k.data(), k.size());
    if (key.empty() || key[0] == ':' || key.rfind("grpc-", 0) == 0 || key == "user-agent") continue;
    if (to_triton && f.opt.key_names.count(key)) continue;
    to->AddMetadata(key, std::string(v.data(), v.size()));
  }
  if (from->deadline() != std::chrono::system_clock::time_point::max()) to->set_deadline(from->raw_deadline());
}


// The async ModelInfer path (infer.cc): a raw-method service, and the loop that serves one completion queue.
class InferService : public grpc::Service {
 public:
  InferService();
  void Request(grpc::ServerContext* ctx, ByteBuffer* req, grpc::ServerAsyncResponseWriter<ByteBuffer>* writer,
               grpc::ServerCompletionQueue* cq, void* tag);
};
void ServeInfer(Front* f, InferService* service, grpc::ServerCompletionQueue* cq);

}  // namespace e3front
