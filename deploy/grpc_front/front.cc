// e3-grpc-front: the public gRPC port of `e3 serve` (see e3/deploy/grpc_front_process.py for who starts it).
//
// Why C++: the Python gRPC guard (grpc.aio) cost 0.74-0.96 ms of CPU per call on a 2-core machine, against
// 1.3-1.5 ms for tritonserver itself, so at 64 clients gRPC through it ran at 0.52-0.71x Triton's own port;
// a C++ generic forwarder costs 0.21-0.35 ms. So the hot path lives here:
//   * ModelInfer and every message of ModelStreamInfer: parsed, checked (check.cc: the Python guard's rules),
//     re-serialised, forwarded to Triton's private gRPC socket (--triton); refused: INVALID_ARGUMENT naming the
//     problem (on a stream: an error response naming it and the request's id; the stream goes on);
//   * every other method, as raw bytes, to the Python gRPC guard on its private socket (--guard), which keeps
//     the API key, the control API, the supervisor's notifications and the readiness faults;
//   * a message over --max-message-bytes: RESOURCE_EXHAUSTED from gRPC itself, before a handler sees it.
// Messages: the generated classes of Triton's own protos. Decision: protoc --cpp_out over a FileDescriptorSet
// written at build time from tritonclient's grpc_service_pb2 (build.sh), not DynamicMessage: the parse, the
// checks and the re-serialisation then run as compiled code, the same code Triton's own gRPC frontend runs on
// the same message (protobuf's C++ parser), so the front and Triton cannot read one message two ways.
//
// Control, from the process that started it, one line each on stdin (answers on stdout):
//   abort MODEL   end every ModelInfer call in flight to MODEL with UNAVAILABLE  -> "aborted N"
//   stats         answers by status code and refused messages                    -> "stats CODE=N ... bad=N"
//   end of input  stop (the parent has gone)
// Nothing secret reaches this process: the API key stays with the Python guard.
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <absl/synchronization/mutex.h>
#include <google/protobuf/stubs/logging.h>
#include <sys/prctl.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "check.h"
#include "options.h"

namespace e3front {
namespace {

using grpc::ByteBuffer;
using grpc::Status;
using grpc::StatusCode;
using inference::ModelInferRequest;
using inference::ModelStreamInferResponse;

const std::string kService = "/inference.GRPCInferenceService/";

class Unary;

// What every call shares: the options, the two upstream stubs, the calls in flight, the counters.
struct Front {
  Options opt;
  std::unique_ptr<grpc::GenericStub> triton, guard;
  std::mutex mu;
  std::unordered_map<std::string, std::unordered_set<Unary*>> inflight;   // model -> ModelInfer calls in flight
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

bool Parse(ByteBuffer* in, ModelInferRequest* req) {
  return grpc::GenericDeserialize<grpc::ProtoBufferReader, ModelInferRequest>(in, req).ok();
}

ByteBuffer Serialise(const google::protobuf::Message& m) {
  ByteBuffer out;
  bool own;
  grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(m, &out, &own);
  return out;
}

// The client's metadata for the next hop (not gRPC's own; toward Triton, not the key's header either) and its
// deadline.
void Carry(const Front& f, grpc::GenericCallbackServerContext* from, grpc::ClientContext* to, bool to_triton) {
  for (const auto& [k, v] : from->client_metadata()) {
    std::string key(k.data(), k.size());
    if (key.empty() || key[0] == ':' || key.rfind("grpc-", 0) == 0 || key == "user-agent") continue;
    if (to_triton && f.opt.key_names.count(key)) continue;
    to->AddMetadata(key, std::string(v.data(), v.size()));
  }
  if (from->deadline() != std::chrono::system_clock::time_point::max()) to->set_deadline(from->raw_deadline());
}

// One unary call: ModelInfer (checked, to Triton) or any other method (as it came, to the Python guard).
class Unary : public grpc::ServerGenericBidiReactor {
 public:
  Unary(Front* f, grpc::GenericCallbackServerContext* ctx, bool infer) : f_(f), ctx_(ctx), infer_(infer) {
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return End(Status(StatusCode::INVALID_ARGUMENT, "the call carried no message"));
    grpc::GenericStub* stub = f_->guard.get();
    if (infer_) {
      ModelInferRequest req;
      std::string error = "the message is not a ModelInferRequest";
      if (!Parse(&in_, &req) || !CheckInfer(f_->opt.limits, &req, &error)) {
        std::string message = "malformed ModelInfer request: " + error;
        f_->Refused(message);
        return End(Status(StatusCode::INVALID_ARGUMENT, message));
      }
      model_ = req.model_name();
      out_ = Serialise(req);
      stub = f_->triton.get();
      std::lock_guard<std::mutex> lock(f_->mu);
      f_->inflight[model_].insert(this);
      registered_ = true;
    } else {
      out_ = in_;
    }
    Carry(*f_, ctx_, &cctx_, infer_);
    stub->UnaryCall(&cctx_, ctx_->method(), grpc::StubOptions(), &out_, &resp_, [this](Status s) { Answered(s); });
  }

  void Abort() {   // under f_->mu
    aborted_ = true;
    cctx_.TryCancel();
  }

  void OnCancel() override { cctx_.TryCancel(); }
  void OnDone() override { delete this; }

 private:
  void Answered(Status s) {
    if (registered_) {
      std::lock_guard<std::mutex> lock(f_->mu);
      auto it = f_->inflight.find(model_);
      it->second.erase(this);
      if (it->second.empty()) f_->inflight.erase(it);
    }
    if (aborted_ && !s.ok())
      s = Status(StatusCode::UNAVAILABLE, "model " + model_ + " lost its Python stub while this call was in flight; "
                                          "it is being reloaded, retry shortly");
    if (!s.ok()) return End(s);
    f_->Count(StatusCode::OK);
    StartWriteAndFinish(&resp_, grpc::WriteOptions(), s);
  }

  void End(const Status& s) {
    f_->Count(s.error_code());
    Finish(s);
  }

  Front* f_;
  grpc::GenericCallbackServerContext* ctx_;
  bool infer_;
  bool registered_ = false;
  std::atomic<bool> aborted_{false};
  std::string model_;
  grpc::ClientContext cctx_;
  ByteBuffer in_, out_, resp_;
};

// ModelStreamInfer: the client's messages checked one by one and forwarded on one stream to Triton; Triton's
// answers and the front's own error responses go back as they come, one write at a time.
class Stream : public grpc::ServerGenericBidiReactor {
 public:
  Stream(Front* f, grpc::GenericCallbackServerContext* ctx) : f_(f), up_(this) {
    Carry(*f_, ctx, &cctx_, true);
    f_->triton->PrepareBidiStreamingCall(&cctx_, ctx->method(), grpc::StubOptions(), &up_);
    up_.AddHold();   // upstream writes start from this reactor's callbacks: OnDone waits until they cannot
    up_.StartRead(&up_in_);
    up_.StartCall();
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!ok) {   // the client has sent everything
      client_done_ = true;
      return MaybeWritesDone(lock);
    }
    ModelInferRequest req;
    std::string error = "the message is not a ModelInferRequest";
    bool parsed = Parse(&in_, &req);
    if (!parsed || !CheckInfer(f_->opt.limits, &req, &error)) {
      ModelStreamInferResponse answer;
      answer.set_error_message("malformed ModelStreamInfer request: " + error);
      if (parsed) answer.mutable_infer_response()->set_id(req.id());
      f_->Refused(answer.error_message());
      Push(Serialise(answer));
      if (!finished_) StartRead(&in_);
      return;
    }
    if (released_) return;   // Triton's side has ended: the stream is finishing
    up_out_ = Serialise(req);
    up_writing_ = true;
    up_.StartWrite(&up_out_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) queue_.clear();   // the client has gone
    else if (!queue_.empty()) queue_.pop_front();
    WriteNext();
  }

  void OnCancel() override { cctx_.TryCancel(); }
  void OnDone() override { delete this; }

 private:
  class Upstream : public grpc::ClientBidiReactor<ByteBuffer, ByteBuffer> {
   public:
    explicit Upstream(Stream* s) : s_(s) {}
    void OnReadDone(bool ok) override { s_->UpRead(ok); }
    void OnWriteDone(bool ok) override { s_->UpWritten(ok); }
    void OnDone(const Status& st) override { s_->UpDone(st); }
   private:
    Stream* s_;
  };

  void UpRead(bool ok) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!ok) return Release(lock);   // Triton has ended the stream
    Push(up_in_);
    up_.StartRead(&up_in_);
  }

  void UpWritten(bool ok) {
    std::unique_lock<std::mutex> lock(mu_);
    up_writing_ = false;
    if (!ok) return Release(lock);
    if (client_done_) return MaybeWritesDone(lock);
    if (!finished_) StartRead(&in_);
  }

  void UpDone(const Status& st) {
    std::lock_guard<std::mutex> lock(mu_);
    up_status_ = st;
    up_done_ = true;
    WriteNext();
  }

  void MaybeWritesDone(std::unique_lock<std::mutex>& lock) {
    if (up_writing_ || released_) return;
    up_.StartWritesDone();
    Release(lock);
  }

  void Release(std::unique_lock<std::mutex>& lock) {   // no upstream operation starts after this
    if (released_) return;
    released_ = true;
    lock.unlock();
    up_.RemoveHold();
    lock.lock();
  }

  void Push(ByteBuffer b) {   // under mu_
    queue_.push_back(std::move(b));
    WriteNext();
  }

  void WriteNext() {   // under mu_: the next answer, or the end once Triton's side is done and all is written
    if (writing_ || finished_) return;
    if (!queue_.empty()) {
      writing_ = true;
      StartWrite(&queue_.front());
      return;
    }
    if (up_done_) {
      finished_ = true;
      f_->Count(up_status_.error_code());
      Finish(up_status_);
    }
  }

  Front* f_;
  Upstream up_;
  grpc::ClientContext cctx_;
  std::mutex mu_;
  ByteBuffer in_, up_in_, up_out_;
  std::deque<ByteBuffer> queue_;
  Status up_status_;
  bool client_done_ = false, up_writing_ = false, released_ = false, writing_ = false, up_done_ = false,
       finished_ = false;
};

class Service : public grpc::CallbackGenericService {
 public:
  explicit Service(Front* f) : f_(f) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    const std::string& m = ctx->method();
    if (m == kService + "ModelStreamInfer") return new Stream(f_, ctx);
    return new Unary(f_, ctx, m == kService + "ModelInfer");
  }
 private:
  Front* f_;
};

std::shared_ptr<grpc::Channel> Channel(const std::string& target, int64_t max_send) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);   // Triton's answers: as large as they are
  args.SetMaxSendMessageSize(static_cast<int>(std::min<int64_t>(max_send, INT32_MAX)));
  // a restarted Triton is back in seconds: reconnect within a second, not gRPC's default of up to 2 minutes
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);   // a call is never sent twice (an inference would run twice)
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

std::string StatsLine(Front& f) {
  static const char* names[17] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                                  "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                  "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
                                  "UNAUTHENTICATED"};
  std::string line = "stats";
  for (int c = 0; c < 17; ++c)
    if (uint64_t n = f.codes[c].load()) line += std::string(" ") + names[c] + "=" + std::to_string(n);
  return line + " bad=" + std::to_string(f.bad.load());
}

int Serve(Options opt) {
  prctl(PR_SET_PDEATHSIG, SIGTERM);   // never outlive e3 serve
  Front f;
  f.opt = std::move(opt);
  f.triton = std::make_unique<grpc::GenericStub>(Channel(f.opt.triton, f.opt.max_message_bytes + (1 << 20)));
  f.guard = std::make_unique<grpc::GenericStub>(Channel(f.opt.guard, f.opt.max_message_bytes + (1 << 20)));
  Service service(&f);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(f.opt.listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(f.opt.max_message_bytes, INT32_MAX)));
  builder.SetMaxSendMessageSize(-1);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);   // a second server on the port is an error, not a share
  auto server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "e3-grpc-front: cannot listen on %s\n", f.opt.listen.c_str());
    return 2;
  }
  std::cout << "listening " << port << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.rfind("abort ", 0) == 0) {
      std::string model = line.substr(6);
      int n = 0;
      {
        std::lock_guard<std::mutex> lock(f.mu);
        auto it = f.inflight.find(model);
        if (it != f.inflight.end())
          for (Unary* call : it->second) { call->Abort(); ++n; }
      }
      std::cout << "aborted " << n << std::endl;
    } else if (line == "stats") {
      std::cout << StatsLine(f) << std::endl;
    } else {
      std::cout << "unknown command" << std::endl;
    }
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return 0;
}

// --check: messages on stdin (each a 4-byte little-endian length, then the bytes); for each, on stdout, 'A' and
// the message to forward or 'R' and the reason, each with its 4-byte length (the differential test's door).
int CheckStdin(const Options& opt) {
  std::string data;
  unsigned char len[4];
  while (std::fread(len, 1, 4, stdin) == 4) {
    uint32_t n = len[0] | (len[1] << 8) | (len[2] << 16) | (static_cast<uint32_t>(len[3]) << 24);
    data.resize(n);
    if (n && std::fread(&data[0], 1, n, stdin) != n) return 1;
    ModelInferRequest req;
    std::string out = "the message is not a ModelInferRequest";
    char verdict = 'R';
    if (req.ParseFromString(data) && CheckInfer(opt.limits, &req, &out)) {
      verdict = 'A';
      out = req.SerializeAsString();
    }
    uint32_t m = out.size();
    unsigned char head[5] = {static_cast<unsigned char>(verdict), static_cast<unsigned char>(m),
                             static_cast<unsigned char>(m >> 8), static_cast<unsigned char>(m >> 16),
                             static_cast<unsigned char>(m >> 24)};
    std::fwrite(head, 1, 5, stdout);
    std::fwrite(out.data(), 1, out.size(), stdout);
    std::fflush(stdout);
  }
  return 0;
}

void Quiet(google::protobuf::LogLevel, const char*, int, const std::string&) {}   // a bad message is not news

}  // namespace
}  // namespace e3front

int main(int argc, char** argv) {
  // absl's mutex deadlock detection (on in Debian's build) walks a lock graph on every gRPC lock: not needed here
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  google::protobuf::SetLogHandler(&e3front::Quiet);   // the parser logs every invalid UTF-8 string it refuses
  e3front::Options opt;
  std::string error;
  if (!e3front::ParseOptions(argc, argv, &opt, &error)) {
    std::fprintf(stderr, "e3-grpc-front: %s\n(run with --help for every option)\n", error.c_str());
    return 2;
  }
  if (opt.help) {
    std::fputs(e3front::kUsage, stdout);
    return 0;
  }
  return opt.check ? e3front::CheckStdin(opt) : e3front::Serve(std::move(opt));
}
