// The emulator's runtime (see cuda_emu.h): the fiber scheduler for one block, warp exchange,
// barrier checks, the kernel registry and the C entry point `infer_emu_launch` that the Rust tests
// call through libloading. Device pointers are plain host pointers.
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda_emu.h"

namespace emu {

thread_local ThreadCtx* cur_thread = nullptr;
thread_local dim3 cur_block, cur_grid_dim, cur_block_dim;
thread_local unsigned char* cur_dyn_smem = nullptr;

namespace {

// Fiber switching. On x86-64 a hand-written switch (callee-saved registers, MXCSR and the x87
// control word): ucontext's swapcontext makes a sigprocmask system call per switch, which made
// the emulator spend most of its time in the kernel. Elsewhere, ucontext.
#if defined(__x86_64__)
extern "C" void infer_emu_switch(void** save_sp, void* new_sp);
asm(R"(
.text
.globl infer_emu_switch
.hidden infer_emu_switch
.type infer_emu_switch,@function
infer_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size infer_emu_switch, .-infer_emu_switch
)");
struct Context {
  void* sp = nullptr;
};
inline void ctx_switch(Context& from, Context& to) { infer_emu_switch(&from.sp, to.sp); }
/// Prepares `c` to start `entry` on the stack [base, base + size).
inline void ctx_make(Context& c, char* base, size_t size, void (*entry)()) {
  uintptr_t top = ((uintptr_t)(base + size)) & ~(uintptr_t)15;
  uint64_t* s = (uint64_t*)(top - 8);  // entry's frame sees rsp = 8 mod 16, as after a call
  *s = 0;                               // fake return address of entry (it never returns)
  *--s = (uint64_t)(uintptr_t)entry;    // popped by `ret`
  for (int i = 0; i < 6; i++) *--s = 0; // rbp rbx r12 r13 r14 r15
  *--s = 0x037F00001F80ull;             // MXCSR default (low), x87 control word default (high)
  c.sp = s;
}
#else
struct Context {
  ucontext_t uc;
};
inline void ctx_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline void ctx_make(Context& c, char* base, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = base;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

enum class St { Run, Barrier, Warp, Done };

struct Fiber {
  ThreadCtx t;
  Context ctx;
  St st = St::Run;
  const char* file = "";
  int line = 0;
  // warp exchange: what this lane deposited and what it gets back
  uint64_t give = 0, got = 0;
  int arg = 0;
  ShflKind kind = ShflKind::Xor;
  bool is_ballot = false;
  unsigned mask = 0;
};

struct Launch {
  Invoke fn = nullptr;
  void** args = nullptr;
  std::vector<Fiber> fibers;
  Context sched;
  Fiber* running = nullptr;
  std::string error;
};

thread_local Launch* L = nullptr;
constexpr size_t STACK = 128 * 1024;

std::map<std::string, Invoke>& registry() {
  static std::map<std::string, Invoke> r;
  return r;
}

void fiber_main() {
  L->fn(L->args);
  L->running->st = St::Done;
  ctx_switch(L->running->ctx, L->sched);
}

void yield_to_scheduler() { ctx_switch(L->running->ctx, L->sched); }

std::string site(const Fiber& f) {
  return std::string(f.file) + ":" + std::to_string(f.line);
}

std::string who(const Fiber& f) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "thread (%u,%u,%u) of block (%u,%u,%u)", f.t.tid.x, f.t.tid.y,
                f.t.tid.z, cur_block.x, cur_block.y, cur_block.z);
  return buf;
}

std::string describe(const Fiber& f) {
  switch (f.st) {
    case St::Done: return who(f) + " exited";
    case St::Barrier: return who(f) + " waits at __syncthreads " + site(f);
    case St::Warp: return who(f) + " waits at a warp op " + site(f);
    default: return who(f) + " runs";
  }
}

/// Resolves the warp ops of warp `w` if all its lanes wait at one; returns true if released.
/// Sets L->error on divergence.
bool try_release_warp(size_t lo, size_t hi) {
  Fiber* first = nullptr;
  for (size_t i = lo; i < hi; i++) {
    Fiber& f = L->fibers[i];
    if (f.st == St::Warp) {
      first = &f;
      break;
    }
  }
  if (!first) return false;
  unsigned mask = first->mask;
  for (size_t i = lo; i < hi; i++) {
    Fiber& f = L->fibers[i];
    bool in_mask = (mask >> f.t.lane) & 1u;
    if (!in_mask) continue;
    if (f.st != St::Warp || f.line != first->line || f.file != first->file) {
      L->error = "divergent warp op: " + describe(*first) + " but " + describe(f);
      return false;
    }
  }
  size_t n = hi - lo;
  if (first->is_ballot) {
    unsigned bits = 0;
    for (size_t i = lo; i < hi; i++)
      if (((mask >> L->fibers[i].t.lane) & 1u) && L->fibers[i].give) bits |= 1u << L->fibers[i].t.lane;
    for (size_t i = lo; i < hi; i++) L->fibers[i].got = bits;
  } else {
    for (size_t i = lo; i < hi; i++) {
      Fiber& f = L->fibers[i];
      if (!((mask >> f.t.lane) & 1u)) continue;
      int src = 0;
      int lane = (int)f.t.lane;
      switch (f.kind) {
        case ShflKind::Xor: src = lane ^ f.arg; break;
        case ShflKind::Idx: src = f.arg & 31; break;
        case ShflKind::Down: src = lane + f.arg < 32 ? lane + f.arg : lane; break;
        case ShflKind::Up: src = lane - f.arg >= 0 ? lane - f.arg : lane; break;
      }
      if (src >= (int)n || !((mask >> src) & 1u)) {
        L->error = "warp op reads lane " + std::to_string(src) + " outside the mask/warp at " +
                   site(f);
        return false;
      }
      f.got = L->fibers[lo + src].give;
    }
  }
  for (size_t i = lo; i < hi; i++)
    if ((mask >> L->fibers[i].t.lane) & 1u) L->fibers[i].st = St::Run;
  return true;
}

bool run_block() {
  size_t n = L->fibers.size();
  for (;;) {
    bool any_live = false;
    for (size_t i = 0; i < n; i++) {
      Fiber& f = L->fibers[i];
      if (f.st != St::Run) continue;
      L->running = &f;
      cur_thread = &f.t;
      ctx_switch(L->sched, f.ctx);
      if (!L->error.empty()) return false;
    }
    // Every live fiber now waits (or is done).
    bool released = false;
    for (size_t lo = 0; lo < n; lo += 32) {
      size_t hi = lo + 32 < n ? lo + 32 : n;
      if (try_release_warp(lo, hi)) released = true;
      if (!L->error.empty()) return false;
    }
    if (released) continue;
    Fiber* bar = nullptr;
    for (auto& f : L->fibers) {
      if (f.st != St::Done) any_live = true;
      if (f.st == St::Barrier && !bar) bar = &f;
    }
    if (!any_live) return true;
    if (!bar) {
      L->error = "deadlock in warp ops";
      return false;
    }
    for (auto& f : L->fibers) {
      if (f.st != St::Barrier || f.line != bar->line || f.file != bar->file) {
        L->error = "barrier mismatch: " + describe(*bar) + " but " + describe(f);
        return false;
      }
    }
    for (auto& f : L->fibers) f.st = St::Run;
  }
}

}  // namespace

void syncthreads(const char* file, int line) {
  Fiber& f = *L->running;
  f.st = St::Barrier;
  f.file = file;
  f.line = line;
  yield_to_scheduler();
  cur_thread = &f.t;
}

uint64_t shfl(unsigned mask, uint64_t v, int arg, ShflKind kind, const char* file, int line) {
  Fiber& f = *L->running;
  f.st = St::Warp;
  f.file = file;
  f.line = line;
  f.give = v;
  f.arg = arg;
  f.kind = kind;
  f.is_ballot = false;
  f.mask = mask;
  yield_to_scheduler();
  cur_thread = &f.t;
  return f.got;
}

unsigned ballot(unsigned mask, bool pred, const char* file, int line) {
  Fiber& f = *L->running;
  f.st = St::Warp;
  f.file = file;
  f.line = line;
  f.give = pred ? 1 : 0;
  f.is_ballot = true;
  f.mask = mask;
  yield_to_scheduler();
  cur_thread = &f.t;
  return (unsigned)f.got;
}

half_t f2h(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t exp = (x >> 23) & 0xffu, man = x & 0x7fffffu;
  if (exp == 0xff) return {(uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0u))};
  int e = (int)exp - 127 + 15;
  if (e >= 31) return {(uint16_t)(sign | 0x7c00u)};
  if (e <= 0) {
    if (e < -10) return {(uint16_t)sign};
    man |= 0x800000u;
    uint32_t shift = (uint32_t)(14 - e);
    uint32_t h = man >> shift, rem = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) h++;
    return {(uint16_t)(sign | h)};
  }
  uint32_t h = ((uint32_t)e << 10) | (man >> 13), rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;  // may carry into the exponent: correct
  return {(uint16_t)(sign | h)};
}

float h2f(half_t h) {
  uint32_t sign = (uint32_t)(h.bits & 0x8000u) << 16, exp = (h.bits >> 10) & 0x1fu,
           man = h.bits & 0x3ffu, x;
  if (exp == 0) {
    if (man == 0) {
      x = sign;
    } else {
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while (!(man & 0x400u));
      x = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    x = sign | 0x7f800000u | (man << 13);
  } else {
    x = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

Registrar::Registrar(const char* name, Invoke f) { registry()[name] = f; }

}  // namespace emu

unsigned emu_live_mask() { return 0xffffffffu; }

/// Runs kernel `name` over the grid. Returns 0 on success, 1 for an unknown kernel, 2 for an
/// emulation error (message in `err`).
extern "C" int infer_emu_launch(const char* name, const unsigned* grid, const unsigned* block,
                                unsigned smem, void** args, char* err, size_t err_len) {
  using namespace emu;
  auto it = registry().find(name);
  auto report = [&](const std::string& m) {
    if (err_len) std::snprintf(err, err_len, "%s", m.c_str());
  };
  if (it == registry().end()) {
    report(std::string("no kernel named ") + name);
    return 1;
  }
  size_t nthreads = (size_t)block[0] * block[1] * block[2];
  if (nthreads == 0 || nthreads > 1024) {
    report("block of " + std::to_string(nthreads) + " threads");
    return 2;
  }
  Launch launch;
  Launch* saved = L;
  L = &launch;
  launch.fn = it->second;
  launch.args = args;
  launch.fibers.resize(nthreads);
  // Fiber stacks, kept per OS thread across launches (uninitialised: a fresh stack is written
  // before it is read).
  static thread_local std::vector<std::unique_ptr<char[]>> stacks;
  while (stacks.size() < nthreads) stacks.emplace_back(new char[STACK]);
  std::vector<unsigned char> dyn(smem + 16);
  cur_dyn_smem = dyn.data();
  cur_grid_dim = {grid[0], grid[1], grid[2]};
  cur_block_dim = {block[0], block[1], block[2]};
  int rc = 0;
  for (unsigned bz = 0; bz < grid[2] && rc == 0; bz++)
    for (unsigned by = 0; by < grid[1] && rc == 0; by++)
      for (unsigned bx = 0; bx < grid[0] && rc == 0; bx++) {
        cur_block = {bx, by, bz};
        for (size_t i = 0; i < nthreads; i++) {
          Fiber& f = launch.fibers[i];
          f = Fiber{};
          f.t.tid = {(unsigned)(i % block[0]), (unsigned)(i / block[0] % block[1]),
                     (unsigned)(i / block[0] / block[1])};
          f.t.lane = (unsigned)(i % 32);
          f.t.warp = (unsigned)(i / 32);
          ctx_make(f.ctx, stacks[i].get(), STACK, fiber_main);
        }
        if (!run_block()) {
          report(launch.error);
          rc = 2;
        }
      }
  L = saved;
  cur_thread = nullptr;
  return rc;
}
