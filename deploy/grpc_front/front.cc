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
// ModelInfer runs on gRPC's asynchronous API, one thread per completion queue (infer.cc: the cheapest per call,
// measured); streams and the guard's methods on the callback API (this file).
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

#include <thread>
#include <vector>

#include "front.h"

namespace e3front {
namespace {

using inference::ModelStreamInferResponse;

// One call of any method but ModelInfer and ModelStreamInfer, forwarded as it came to the Python guard.
class Unary : public grpc::ServerGenericBidiReactor {
 public:
  Unary(Front* f, grpc::GenericCallbackServerContext* ctx) : f_(f), ctx_(ctx) { StartRead(&in_); }

  void OnReadDone(bool ok) override {
    if (!ok) return End(Status(StatusCode::INVALID_ARGUMENT, "the call carried no message"));
    Carry(*f_, ctx_, &cctx_, false);
    f_->guard->UnaryCall(&cctx_, ctx_->method(), grpc::StubOptions(), &in_, &resp_, [this](Status s) {
      if (!s.ok()) return End(s);
      f_->Count(StatusCode::OK);
      StartWriteAndFinish(&resp_, grpc::WriteOptions(), s);
    });
  }

  void OnCancel() override { cctx_.TryCancel(); }
  void OnDone() override { delete this; }

 private:
  void End(const Status& s) {
    f_->Count(s.error_code());
    Finish(s);
  }

  Front* f_;
  grpc::GenericCallbackServerContext* ctx_;
  grpc::ClientContext cctx_;
  ByteBuffer in_, resp_;
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
    return new Unary(f_, ctx);   // ModelInfer has a service of its own (InferService)
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
  InferService infer;
  grpc::ServerBuilder builder;
  builder.RegisterService(&infer);
  int port = 0;
  builder.AddListeningPort(f.opt.listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(f.opt.max_message_bytes, INT32_MAX)));
  builder.SetMaxSendMessageSize(-1);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);   // a second server on the port is an error, not a share
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> cqs;
  for (int i = 0; i < f.opt.infer_threads; ++i) cqs.push_back(builder.AddCompletionQueue());
  auto server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "e3-grpc-front: cannot listen on %s\n", f.opt.listen.c_str());
    return 2;
  }
  std::vector<std::thread> threads;
  for (auto& cq : cqs) threads.emplace_back(ServeInfer, &f, &infer, cq.get());
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
          for (Abortable* call : it->second) { call->Abort(); ++n; }
      }
      std::cout << "aborted " << n << std::endl;
    } else if (line == "stats") {
      std::cout << StatsLine(f) << std::endl;
    } else {
      std::cout << "unknown command" << std::endl;
    }
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  for (auto& cq : cqs) cq->Shutdown();
  for (auto& t : threads) t.join();
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
