//! Kernel launches replayed as CUDA graphs. A decode step is a few hundred small kernels, and
//! queueing each one costs the host a few microseconds (3.8 µs measured on an H100 machine), more
//! than most of them run. The driver therefore queues launches here instead of issuing them; any
//! other stream operation (alloc, free, copy, sync) first [`Graphs::flush`]es the queue, in order.
//! A flushed run of launches whose shape (kernels, grids, blocks, argument counts) was seen once
//! before is built into a graph, instantiated, and from then on replayed with one `cuGraphLaunch`,
//! after the arguments that changed (pointers to this step's tables, say) are set on their nodes.
//! Runs of another shape, short runs and a shape's first sighting are launched one by one.
//! Invariants: the stream sees every operation in the order the host asked for it; a graph's
//! nodes form one chain (each waits for the previous), as the launches on one stream would.
//! With programmatic dependent launch on (`pdl`, sm_90+, `INFER_CUDA_PDL=1`), each link of that
//! chain is a programmatic one, and launches one by one carry the stream attribute that means the
//! same: the next kernel may start once every block of the previous one has passed its
//! `PDL_ENTRY()` (cuda/common.cuh), where it waits for that kernel's completion; a failure of
//! either turns it off for good (said once) and the same work runs with plain links.

use std::collections::HashMap;
use std::ffi::c_void;
use std::hash::{Hash, Hasher};

use anyhow::{anyhow, Result};
use cudarc::driver::sys;

/// One queued launch: the kernel, its dimensions and its arguments' 8-byte slots.
pub struct Queued {
    pub name: &'static str,
    pub func: sys::CUfunction,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub args: Vec<u64>,
}

/// Runs shorter than this are launched directly (building a graph would not pay).
const MIN_RUN: usize = 32;
/// Instantiated graphs kept (a decode step's shape changes only every few hundred tokens).
const MAX_GRAPHS: usize = 8;

/// A graph instantiated for one shape of run, with the arguments its nodes hold now.
struct Built {
    shape: Vec<(usize, [u32; 3], [u32; 3], usize)>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    nodes: Vec<sys::CUgraphNode>,
    args: Vec<Vec<u64>>,
}

pub struct Graphs {
    queue: Vec<Queued>,
    /// Shapes seen once (by hash): the second sighting builds a graph.
    seen: HashMap<u64, u32>,
    built: HashMap<u64, Built>,
    /// Building a graph failed once: launch one by one from then on.
    broken: bool,
    /// Programmatic dependent launch between consecutive kernels (see the module docs).
    pdl: bool,
}

// SAFETY: the raw CUDA handles (functions, graphs, nodes) are plain driver handles usable from any
// thread with the context current; the driver holds this state behind a mutex and binds the
// context before every call into it.
unsafe impl Send for Graphs {}

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(anyhow!("{what}: {e:?}")),
    }
}

/// Node parameters for `q`, pointing into `q.args` through `ptrs` (both must outlive their use).
fn params(q: &mut Queued, ptrs: &mut Vec<*mut c_void>) -> sys::CUDA_KERNEL_NODE_PARAMS {
    ptrs.clear();
    ptrs.extend(q.args.iter_mut().map(|s| s as *mut u64 as *mut c_void));
    // SAFETY: an all-zero CUDA_KERNEL_NODE_PARAMS is valid (null kernel, context and extra);
    // the fields that matter are set below.
    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    p.func = q.func;
    [p.gridDimX, p.gridDimY, p.gridDimZ] = q.grid;
    [p.blockDimX, p.blockDimY, p.blockDimZ] = q.block;
    p.kernelParams = ptrs.as_mut_ptr();
    p
}

impl Graphs {
    /// `pdl`: link consecutive kernels programmatically (only where the device and driver allow
    /// it: compute capability 9.0 and a CUDA 12.3 driver, see `driver::pdl_choice`).
    pub fn new(pdl: bool) -> Graphs {
        Graphs {
            queue: Vec::new(),
            seen: HashMap::new(),
            built: HashMap::new(),
            broken: false,
            pdl,
        }
    }

    /// Plain links from now on, saying why once; graphs built with programmatic links go.
    fn pdl_off(&mut self, e: &anyhow::Error) {
        eprintln!("infer: programmatic dependent launch off ({e:#}); kernels wait for each other");
        self.pdl = false;
        self.clear();
    }

    pub fn push(&mut self, q: Queued) {
        self.queue.push(q);
    }

    /// Issues every queued launch on `stream` (see the module docs). The context must be current.
    pub fn flush(&mut self, stream: sys::CUstream) -> Result<()> {
        if self.queue.is_empty() {
            return Ok(());
        }
        let queue = std::mem::take(&mut self.queue);
        let shape: Vec<_> = queue
            .iter()
            .map(|q| (q.func as usize, q.grid, q.block, q.args.len()))
            .collect();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        shape.hash(&mut h);
        let key = h.finish();
        if queue.len() >= MIN_RUN && !self.broken {
            if let Some(b) = self.built.get_mut(&key).filter(|b| b.shape == shape) {
                match replay(b, &queue, stream) {
                    Ok(()) => return Ok(()),
                    Err(e) => self.give_up(&e),
                }
            }
            if self.seen.len() > 4096 {
                self.seen.clear(); // one-off shapes (prefill lengths) must not pile up
            }
            let count = self.seen.entry(key).or_insert(0);
            *count += 1;
            if *count >= 2 && !self.broken {
                if self.built.len() >= MAX_GRAPHS {
                    self.clear();
                }
                let mut built = build(shape.clone(), &queue, self.pdl);
                if let (Err(e), true) = (&built, self.pdl) {
                    self.pdl_off(e);
                    built = build(shape, &queue, false);
                }
                match built {
                    Ok(b) => {
                        // SAFETY: a freshly instantiated graph on the caller's current context.
                        let r = unsafe { sys::cuGraphLaunch(b.exec, stream) };
                        self.built.insert(key, b);
                        return check(r, "launching a CUDA graph");
                    }
                    Err(e) => self.give_up(&e),
                }
            }
        }
        for mut q in queue {
            let mut ptrs: Vec<*mut c_void> = q
                .args
                .iter_mut()
                .map(|s| s as *mut u64 as *mut c_void)
                .collect();
            if self.pdl {
                match launch_pdl(&q, &mut ptrs, stream) {
                    Ok(()) => continue,
                    Err(e) => self.pdl_off(&e),
                }
            }
            // SAFETY: the arguments follow the kernel's C signature (ops.rs spells them); each is
            // read from its 8-byte slot during the call.
            let r = unsafe {
                sys::cuLaunchKernel(
                    q.func,
                    q.grid[0],
                    q.grid[1],
                    q.grid[2],
                    q.block[0],
                    q.block[1],
                    q.block[2],
                    0,
                    stream,
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            check(r, &format!("launching {}", q.name))?;
        }
        Ok(())
    }

    /// Launches one by one from now on (slower, and still correct), saying why once.
    fn give_up(&mut self, e: &anyhow::Error) {
        eprintln!("infer: CUDA graphs unavailable ({e:#}); launching kernels one by one");
        self.broken = true;
        self.clear();
    }

    /// Destroys every instantiated graph.
    fn clear(&mut self) {
        for (_, b) in self.built.drain() {
            // SAFETY: handles created by `build`, destroyed once; the stream is ordered after
            // every launch of them by the driver.
            unsafe {
                sys::cuGraphExecDestroy(b.exec);
                sys::cuGraphDestroy(b.graph);
            }
        }
    }
}

impl Drop for Graphs {
    fn drop(&mut self) {
        self.clear();
    }
}

/// `q` launched with the programmatic stream serialization attribute: it may start before the
/// kernel ahead of it on `stream` has finished (it waits for it in `PDL_ENTRY()`).
fn launch_pdl(q: &Queued, ptrs: &mut [*mut c_void], stream: sys::CUstream) -> Result<()> {
    // SAFETY: an all-zero launch attribute is valid (id 0, value zeroed); id and value are set
    // below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let cfg = sys::CUlaunchConfig {
        gridDimX: q.grid[0],
        gridDimY: q.grid[1],
        gridDimZ: q.grid[2],
        blockDimX: q.block[0],
        blockDimY: q.block[1],
        blockDimZ: q.block[2],
        sharedMemBytes: 0,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: the arguments follow the kernel's C signature (ops.rs spells them), each read from
    // its 8-byte slot during the call; `cfg` and `attr` live across it. Only called with a driver
    // of CUDA 12.3 or newer (`driver::pdl_choice`), which has cuLaunchKernelEx.
    let r = unsafe { sys::cuLaunchKernelEx(&cfg, q.func, ptrs.as_mut_ptr(), std::ptr::null_mut()) };
    check(
        r,
        &format!("launching {} with programmatic serialization", q.name),
    )
}

/// The link from one kernel node to the next under programmatic dependent launch: the next may
/// start once every block of this one has triggered (`griddepcontrol.launch_dependents`) or
/// exited: the port CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC with a programmatic edge, what stream
/// capture records for a launch with programmatic stream serialization (CUDA driver API,
/// `CUgraphEdgeData` and `CUgraphKernelNodePort`).
fn programmatic_edge() -> sys::CUgraphEdgeData {
    sys::CUgraphEdgeData {
        from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
        to_port: 0,
        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
        reserved: [0; 5],
    }
}

/// A graph of `queue` as one chain of kernel nodes, instantiated; with `pdl`, each link is a
/// programmatic one.
fn build(
    shape: Vec<(usize, [u32; 3], [u32; 3], usize)>,
    queue: &[Queued],
    pdl: bool,
) -> Result<Built> {
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: creates an empty graph into `graph`.
    check(
        unsafe { sys::cuGraphCreate(&mut graph, 0) },
        "creating a CUDA graph",
    )?;
    let mut b = Built {
        shape,
        graph,
        exec: std::ptr::null_mut(),
        nodes: Vec::with_capacity(queue.len()),
        args: Vec::with_capacity(queue.len()),
    };
    let mut ptrs = Vec::new();
    for q in queue {
        let mut q = Queued {
            args: q.args.clone(),
            ..*q
        };
        let p = params(&mut q, &mut ptrs);
        let mut node: sys::CUgraphNode = std::ptr::null_mut();
        let prev = b.nodes.last().copied();
        let (deps, n_deps) = match (prev.as_ref(), pdl) {
            (Some(n), false) => (n as *const _, 1),
            _ => (std::ptr::null(), 0), // first node, or linked programmatically below
        };
        // SAFETY: `p` points at argument slots alive for the call (the driver copies them);
        // `deps` is null or one node of this graph.
        let mut r = unsafe { sys::cuGraphAddKernelNode_v2(&mut node, graph, deps, n_deps, &p) };
        if let (sys::CUresult::CUDA_SUCCESS, Some(prev), true) = (r, prev, pdl) {
            let edge = programmatic_edge();
            // SAFETY: both nodes belong to this graph; one edge, its data alive for the call.
            // Only called with a driver of CUDA 12.3 or newer (`driver::pdl_choice`), which has
            // cuGraphAddDependencies_v2.
            r = unsafe { sys::cuGraphAddDependencies_v2(graph, &prev, &node, &edge, 1) };
        }
        if let Err(e) = check(r, &format!("adding {} to a CUDA graph", q.name)) {
            // SAFETY: the graph is ours and not instantiated.
            unsafe { sys::cuGraphDestroy(graph) };
            return Err(e);
        }
        b.nodes.push(node);
        b.args.push(q.args);
    }
    // SAFETY: instantiates the complete graph into `b.exec`.
    let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut b.exec, graph, 0) };
    if let Err(e) = check(r, "instantiating a CUDA graph") {
        // SAFETY: as above.
        unsafe { sys::cuGraphDestroy(graph) };
        return Err(e);
    }
    Ok(b)
}

/// Sets the arguments that changed since the last launch of `b`, then launches it.
fn replay(b: &mut Built, queue: &[Queued], stream: sys::CUstream) -> Result<()> {
    let mut ptrs = Vec::new();
    for (i, q) in queue.iter().enumerate() {
        if q.args == b.args[i] {
            continue;
        }
        let mut q = Queued {
            args: q.args.clone(),
            ..*q
        };
        let p = params(&mut q, &mut ptrs);
        // SAFETY: node i of the graph `b.exec` was instantiated from, same kernel and dimensions
        // (the shape matched); the argument slots live for the call.
        let r = unsafe { sys::cuGraphExecKernelNodeSetParams_v2(b.exec, b.nodes[i], &p) };
        check(r, &format!("updating {} in a CUDA graph", q.name))?;
        b.args[i] = q.args;
    }
    // SAFETY: an instantiated graph on the caller's current context.
    check(
        unsafe { sys::cuGraphLaunch(b.exec, stream) },
        "launching a CUDA graph",
    )
}
