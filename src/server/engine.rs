//! The server's engine thread: it owns the model (runner), the tokenizer's use for decoding and
//! the [`Scheduler`], and runs the step loop; the HTTP side talks to it only through an
//! [`EngineHandle`] (a channel of commands in, one channel of events out per request), so no
//! request handler ever waits on a forward pass, and the step loop never waits on a client.
//!
//! Invariants:
//! - Every submitted request gets exactly one `Done` or `Error` on its channel, unless its
//!   receiver is gone (the client left): the request is then cancelled at the next step, and
//!   its KV blocks return to the pool.
//! - While nothing waits or runs, the thread sleeps on the command channel (no spinning).
//! - [`Snapshot`] is refreshed after every step and every command batch, so `/metrics` and the
//!   queue limit see the scheduler as of at most one step ago.
//! - A panic inside a step ends every request in flight with an error and marks the engine
//!   dead (new requests get 500s); the process stays up to say so.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::UnboundedSender;

use crate::engine::request::{Event, RequestId, RequestSpec};
use crate::engine::runner::Runner;
use crate::engine::scheduler::{Scheduler, SchedulerConfig};
use crate::model::Backend;
use crate::tokenizer::Tokenizer;

/// What the HTTP side asks of the engine.
pub enum Command {
    /// Run a request; its events go to `events`, tagged with `tag` (the choice index: the `n`
    /// choices of one HTTP request share a channel).
    Submit {
        id: RequestId,
        spec: RequestSpec,
        tag: usize,
        events: UnboundedSender<(usize, Event)>,
    },
    /// End a request (its client left); harmless for one already over.
    Cancel(RequestId),
    /// End every request (each ends `Interrupted`), then stop the loop once idle.
    Shutdown,
}

/// The scheduler and KV pool as of the last step, for `/metrics` and admission.
#[derive(Clone, Copy, Debug, Default)]
pub struct Snapshot {
    pub waiting: usize,
    pub running: usize,
    pub kv_blocks_total: usize,
    /// Blocks held by a running sequence.
    pub kv_blocks_used: usize,
    /// Blocks kept only for the prefix cache (evictable).
    pub kv_blocks_cached: usize,
    pub reused_tokens: u64,
    pub computed_tokens: u64,
    pub evicted_blocks: u64,
    pub preemptions: u64,
    pub steps: u64,
    /// Prompt-lookup draft tokens verified, and those kept.
    pub drafted: u64,
    pub accepted: u64,
}

/// The HTTP side's end of the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    snapshot: Arc<Mutex<Snapshot>>,
    dead: Arc<AtomicBool>,
}

impl EngineHandle {
    /// Sends a command; false when the engine thread is gone.
    pub fn send(&self, c: Command) -> bool {
        self.tx.send(c).is_ok()
    }

    pub fn snapshot(&self) -> Snapshot {
        *self.snapshot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The engine panicked or its thread ended: it serves nothing more.
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Relaxed)
    }
}

/// A handle and the receiving end for [`run`].
pub fn channel() -> (EngineHandle, Receiver<Command>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = EngineHandle {
        tx,
        snapshot: Arc::new(Mutex::new(Snapshot::default())),
        dead: Arc::new(AtomicBool::new(false)),
    };
    (handle, rx)
}

/// Where each running request's events go: its choice tag and its response's channel.
type Senders = HashMap<RequestId, (usize, UnboundedSender<(usize, Event)>)>;

/// The step loop, on the calling thread, until [`Command::Shutdown`] has been served (or every
/// handle is dropped) and nothing is left to run. `log` gets one line per engine failure.
pub fn run<B: Backend>(
    runner: &mut Runner<B>,
    tok: &Tokenizer,
    cfg: SchedulerConfig,
    handle: &EngineHandle,
    rx: Receiver<Command>,
    log: &dyn Fn(&str),
) {
    let mut sched = Scheduler::new(cfg);
    let mut senders: Senders = HashMap::new();
    let mut events = Vec::new();
    let mut stopping = false;
    let mut disconnected = false;
    loop {
        // Sleep on the channel while there is nothing to compute.
        if sched.is_idle() {
            if stopping || disconnected {
                break;
            }
            match rx.recv() {
                Ok(c) => apply(c, &mut sched, &mut senders, &mut stopping),
                Err(_) => break,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(c) => apply(c, &mut sched, &mut senders, &mut stopping),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    disconnected = true;
                    break;
                }
            }
        }
        if stopping {
            senders.keys().for_each(|&id| sched.cancel(id));
        }
        if !sched.is_idle() {
            let step =
                std::panic::catch_unwind(AssertUnwindSafe(|| sched.step(runner, tok, &mut events)));
            match step {
                Ok(Ok(())) => {}
                // The scheduler has ended every request in flight with the error (in `events`).
                Ok(Err(e)) => log(&format!("a step failed: {e:#}")),
                Err(_) => {
                    log("a step panicked: the engine stops serving");
                    handle.dead.store(true, Ordering::Relaxed);
                    for (_, (tag, tx)) in senders.drain() {
                        let _ = tx.send((tag, Event::Error("the engine failed".into())));
                    }
                    update(handle, &sched, runner);
                    // Answer whatever still comes, until the server is torn down.
                    for c in rx.iter() {
                        if let Command::Submit { events, tag, .. } = c {
                            let _ =
                                events.send((tag, Event::Error("the engine has failed".into())));
                        }
                    }
                    return;
                }
            }
            // The step's outcome (finished sequences gone, their blocks back) is in the metrics
            // before any of its events reaches a client.
            update(handle, &sched, runner);
            for (id, e) in events.drain(..) {
                let last = matches!(e, Event::Done(_) | Event::Error(_));
                let gone = match senders.get(&id) {
                    Some((tag, tx)) => tx.send((*tag, e)).is_err(),
                    None => false,
                };
                if last {
                    senders.remove(&id);
                } else if gone {
                    // The client left: end it at the next step (its blocks go back then).
                    sched.cancel(id);
                }
            }
        }
        update(handle, &sched, runner);
    }
    update(handle, &sched, runner);
}

fn apply(c: Command, sched: &mut Scheduler, senders: &mut Senders, stopping: &mut bool) {
    match c {
        Command::Submit {
            id,
            spec,
            tag,
            events,
        } => {
            if *stopping {
                let _ = events.send((tag, Event::Error("the server is shutting down".into())));
                return;
            }
            match sched.submit(id, spec) {
                Ok(()) => {
                    senders.insert(id, (tag, events));
                }
                Err(e) => {
                    let _ = events.send((tag, Event::Error(format!("{e:#}"))));
                }
            }
        }
        Command::Cancel(id) => sched.cancel(id),
        Command::Shutdown => *stopping = true,
    }
}

fn update<B: Backend>(handle: &EngineHandle, sched: &Scheduler, runner: &Runner<B>) {
    let pool = runner.pool();
    let cache = pool.stats();
    let st = sched.stats();
    let snap = Snapshot {
        waiting: sched.n_waiting(),
        running: sched.n_running(),
        kv_blocks_total: pool.n_blocks(),
        kv_blocks_used: pool.n_referenced(),
        kv_blocks_cached: pool.n_cached_idle(),
        reused_tokens: cache.reused_tokens,
        computed_tokens: cache.computed_tokens,
        evicted_blocks: cache.evicted_blocks,
        preemptions: st.preemptions,
        steps: st.steps,
        drafted: st.drafted,
        accepted: st.accepted,
    };
    *handle.snapshot.lock().unwrap_or_else(|p| p.into_inner()) = snap;
}
