// ModelInfer, the hot path: gRPC's asynchronous API on completion queues, each served by one thread that takes
// the client's call, checks it, sends it to Triton and answers it, every step of a call on that thread.
//
// Why not the callback API of front.cc: there every call crosses gRPC's executor threads (measured under
// perf_analyzer at 64 clients on 2 cores: a quarter of the front's CPU in the kernel, mostly switching between
// threads); one thread per completion queue, polling the client's and Triton's connections itself, hands nothing
// over. The method is registered raw (ByteBuffer in and out), as generated code registers WithRawMethod_*.
#include <grpcpp/impl/codegen/async_unary_call.h>

#include "front.h"

namespace e3front {

const char kModelInfer[] = "/inference.GRPCInferenceService/ModelInfer";   // gRPC keeps the pointer

namespace {

// One ModelInfer call. Tags: the call itself (its next step), and the call + 1 (gRPC says it is done: a
// cancelled client's call is cancelled at Triton too). Deleted once it has answered and gRPC has said done.
class Call : public Abortable {
 public:
  Call(Front* f, InferService* service, grpc::ServerCompletionQueue* cq) : f_(f), cq_(cq), writer_(&ctx_) {
    ctx_.AsyncNotifyWhenDone(DoneTag());
    service->Request(&ctx_, &in_, &writer_, cq_, this);
  }

  void* DoneTag() { return reinterpret_cast<char*>(this) + 1; }

  // The next step of the call; false when the server is shutting down (no call arrived).
  bool Step(bool ok, InferService* service) {
    switch (state_) {
      case kRequested:
        if (!ok) { state_ = kAnswered; return Release(); }
        new Call(f_, service, cq_);   // the next call of this queue
        return Forward();
      case kForwarding:
        return Answer();
      case kAnswered:
      default:
        return Release();
    }
  }

  bool Done() {   // the done tag
    if (ctx_.IsCancelled()) cctx_.TryCancel();
    return Release();
  }

  void Abort() override {   // under Front::mu
    aborted_ = true;
    cctx_.TryCancel();
  }

 private:
  enum State { kRequested, kForwarding, kAnswered };

  bool Forward() {
    ModelInferRequest req;
    std::string error = "the message is not a ModelInferRequest";
    if (!Parse(&in_, &req) || !CheckInfer(f_->opt.limits, &req, &error)) {
      std::string message = "malformed ModelInfer request: " + error;
      f_->Refused(message);
      return End(Status(StatusCode::INVALID_ARGUMENT, message));
    }
    model_ = req.model_name();
    out_ = Serialise(req);
    {
      std::lock_guard<std::mutex> lock(f_->mu);
      f_->inflight[model_].insert(this);
    }
    Carry(*f_, &ctx_, &cctx_, true);
    state_ = kForwarding;
    upstream_ = f_->triton->PrepareUnaryCall(&cctx_, kModelInfer, out_, cq_);
    upstream_->StartCall();
    upstream_->Finish(&resp_, &status_, this);
    return true;
  }

  bool Answer() {   // Triton has answered (or the call to it failed, was cancelled or aborted)
    {
      std::lock_guard<std::mutex> lock(f_->mu);
      auto it = f_->inflight.find(model_);
      it->second.erase(this);
      if (it->second.empty()) f_->inflight.erase(it);
    }
    if (aborted_ && !status_.ok())
      status_ = Status(StatusCode::UNAVAILABLE, "model " + model_ + " lost its Python stub while this call was in "
                                                "flight; it is being reloaded, retry shortly");
    if (!status_.ok()) return End(status_);
    f_->Count(StatusCode::OK);
    state_ = kAnswered;
    writer_.Finish(resp_, Status::OK, this);
    return true;
  }

  bool End(const Status& s) {
    f_->Count(s.error_code());
    state_ = kAnswered;
    writer_.FinishWithError(s, this);
    return true;
  }

  bool Release() {   // after the answer was sent, and once more after the done tag: the second deletes
    if (++released_ == 2) delete this;
    return true;
  }

  Front* f_;
  grpc::ServerCompletionQueue* cq_;
  grpc::ServerContext ctx_;
  grpc::ServerAsyncResponseWriter<ByteBuffer> writer_;
  grpc::ClientContext cctx_;
  std::unique_ptr<grpc::ClientAsyncResponseReader<ByteBuffer>> upstream_;
  ByteBuffer in_, out_, resp_;
  Status status_;
  State state_ = kRequested;
  std::string model_;
  std::atomic<bool> aborted_{false};
  int released_ = 0;
};

}  // namespace

InferService::InferService() {
  AddMethod(new grpc::internal::RpcServiceMethod(kModelInfer, grpc::internal::RpcMethod::NORMAL_RPC, nullptr));
  MarkMethodRaw(0);
}

void InferService::Request(grpc::ServerContext* ctx, ByteBuffer* req,
                           grpc::ServerAsyncResponseWriter<ByteBuffer>* writer, grpc::ServerCompletionQueue* cq,
                           void* tag) {
  RequestAsyncUnary(0, ctx, req, writer, cq, cq, tag);
}

void ServeInfer(Front* f, InferService* service, grpc::ServerCompletionQueue* cq) {
  for (int i = 0; i < 16; ++i) new Call(f, service, cq);   // calls waiting to be taken
  void* tag;
  bool ok;
  while (cq->Next(&tag, &ok)) {
    auto bits = reinterpret_cast<uintptr_t>(tag);
    if (bits & 1) reinterpret_cast<Call*>(bits - 1)->Done();
    else static_cast<Call*>(tag)->Step(ok, service);
  }
}

}  // namespace e3front
