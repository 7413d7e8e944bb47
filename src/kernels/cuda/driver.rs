//! The real-GPU implementation of [`Launch`] over cudarc's driver API (dynamically loaded:
//! building needs no CUDA), and [`probe`], which finds a usable device without ever panicking:
//! it checks for the driver library before touching cudarc (whose calls panic without it), and
//! turns any panic of a broken driver library into an error.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream};

use super::graphs::{Graphs, Queued};
use super::launch::{Arg, Launch, Timed};
use super::module::{self, Image};

/// A CUDA device with the kernels loaded.
pub struct CudaDriver {
    /// Queued launches and the graphs they are replayed as (`None`: launched one by one, with
    /// INFER_CUDA_GRAPHS=0). First, so that its graphs are destroyed while the context lives.
    graphs: Option<Mutex<Graphs>>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Module,
    funcs: Mutex<HashMap<String, Func>>,
    desc: String,
    /// While profiling: each launch with the events recorded around it (graphs bypassed).
    profile: Mutex<Option<Vec<Profiled>>>,
}

/// A launch being timed: kernel, arguments, and the events before and after it.
struct Profiled {
    name: &'static str,
    grid: [u32; 3],
    args: Vec<Arg>,
    start: CudaEvent,
    end: CudaEvent,
}

/// A loaded module handle.
struct Module(sys::CUmodule);
/// A kernel handle.
#[derive(Clone, Copy)]
struct Func(sys::CUfunction, &'static str);
// SAFETY: CUDA driver handles may be used from any thread once the context is current there
// (every entry point below binds it first); the module outlives every function handle.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}
unsafe impl Send for Func {}

/// Whether a CUDA driver library (`libcuda.so`) can be loaded at all, working or not.
pub fn library_present() -> bool {
    // SAFETY: only tries to dlopen the library names cudarc would use; nothing is called in it.
    unsafe { sys::is_culib_present() }
}

/// Why no GPU is used, in words for the `--device auto` fallback line.
pub fn probe() -> Result<Arc<CudaDriver>> {
    if !library_present() {
        bail!("no CUDA driver library (libcuda.so) found");
    }
    match std::panic::catch_unwind(open) {
        Ok(r) => r,
        Err(_) => bail!("the CUDA driver library is unusable (a required symbol is missing)"),
    }
}

fn open() -> Result<Arc<CudaDriver>> {
    result::init().map_err(|e| anyhow!("CUDA driver init failed: {}", cu(&e)))?;
    let n =
        result::device::get_count().map_err(|e| anyhow!("counting CUDA devices: {}", cu(&e)))?;
    if n < 1 {
        bail!("the CUDA driver reports no device");
    }
    let ctx = CudaContext::new(0).map_err(|e| anyhow!("creating a CUDA context: {}", cu(&e)))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| anyhow!("reading the compute capability: {}", cu(&e)))?;
    let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
    let Some(image) = module::select(major as u32, minor as u32) else {
        bail!("{name} has compute capability {major}.{minor}; the CUDA backend needs 8.0 or newer");
    };
    let (loaded, what) = match image {
        // SAFETY: a complete cubin image embedded at build time; the driver copies it.
        Image::Cubin { arch, bytes } => (unsafe { load(bytes) }, format!("cubin sm_{arch}")),
        Image::Ptx { arch, text } => {
            let c = CString::new(text).context("embedded PTX holds a NUL byte")?;
            // SAFETY: a NUL-terminated PTX text; the driver JIT-compiles and copies it.
            (
                unsafe { load(c.as_bytes_with_nul()) },
                format!("PTX sm_{arch} (JIT)"),
            )
        }
    };
    let module =
        loaded.map_err(|e| anyhow!("loading the kernels ({what}) on {name}: {}", cu(&e)))?;
    let stream = ctx.default_stream();
    let graphs = std::env::var("INFER_CUDA_GRAPHS").as_deref() != Ok("0");
    let mut version = 0;
    // SAFETY: writes the driver's version into `version`; present in every CUDA driver.
    let _ = unsafe { sys::cuDriverGetVersion(&mut version) };
    let pdl = match pdl_choice(
        std::env::var("INFER_CUDA_PDL").ok().as_deref(),
        graphs,
        major,
        version,
    ) {
        Ok(on) => on,
        Err(why) => {
            eprintln!("infer: INFER_CUDA_PDL=1 ignored: {why}");
            false
        }
    };
    Ok(Arc::new(CudaDriver {
        desc: format!(
            "{name} (sm_{major}{minor}, {what}{})",
            if pdl {
                ", programmatic dependent launch"
            } else {
                ""
            }
        ),
        ctx,
        stream,
        module: Module(module),
        funcs: Mutex::new(HashMap::new()),
        graphs: graphs.then(|| Mutex::new(Graphs::new(pdl))),
        profile: Mutex::new(None),
    }))
}

/// Whether kernels are launched with programmatic dependent launch (`src/kernels/cuda/graphs.rs`):
/// only when asked for (`INFER_CUDA_PDL=1`; off by default until a GPU has measured it), with
/// graphs on (the queue that applies it), on compute capability 9.0 or newer (`griddepcontrol`)
/// and a driver of CUDA 12.3 or newer (`driver`, as cuDriverGetVersion reports it: 12030), which
/// has every entry point it uses; asked for but impossible, the reason why.
fn pdl_choice(env: Option<&str>, graphs: bool, cc_major: i32, driver: i32) -> Result<bool, String> {
    if env != Some("1") {
        return Ok(false);
    }
    if !graphs {
        return Err("it needs CUDA graphs (INFER_CUDA_GRAPHS=0 is set)".into());
    }
    if cc_major < 9 {
        return Err(format!(
            "the GPU has compute capability {cc_major}.x; it needs 9.0 or newer"
        ));
    }
    if driver < 12030 {
        return Err(format!(
            "the driver supports CUDA {}.{}; it needs 12.3 or newer",
            driver / 1000,
            driver % 1000 / 10
        ));
    }
    Ok(true)
}

/// The error's name, without asking the driver (a fake or broken driver may lack
/// cuGetErrorString, which `DriverError`'s Debug calls).
fn cu(e: &result::DriverError) -> String {
    format!("{:?}", e.0)
}

/// # Safety
/// `image` must be a complete cubin or NUL-terminated PTX; a context must be current.
unsafe fn load(image: &[u8]) -> Result<sys::CUmodule, result::DriverError> {
    // An 8-byte aligned copy: an embedded image is only byte-aligned, and an ELF image is read
    // as 8-byte words.
    let mut words = vec![0u64; image.len().div_ceil(8)];
    // SAFETY: `words` holds at least image.len() bytes; the regions are distinct.
    unsafe {
        std::ptr::copy_nonoverlapping(image.as_ptr(), words.as_mut_ptr() as *mut u8, image.len())
    };
    result::module::load_data(words.as_ptr() as *const c_void)
}

impl CudaDriver {
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("binding the CUDA context: {}", cu(&e)))
    }

    /// Issues the queued launches (before any other stream operation: see `graphs`).
    fn flush(&self) -> Result<()> {
        match &self.graphs {
            Some(g) => g
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .flush(self.stream.cu_stream()),
            None => Ok(()),
        }
    }

    fn func(&self, name: &str) -> Result<Func> {
        let mut funcs = self.funcs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = funcs.get(name) {
            return Ok(*f);
        }
        let cname = CString::new(name)?;
        // SAFETY: the module is loaded and stays loaded while self lives.
        let f = unsafe { result::module::get_function(self.module.0, cname) }
            .map_err(|e| anyhow!("kernel {name} not found in the embedded module: {}", cu(&e)))?;
        // Kernel names are few and live as long as the process (for graph error messages).
        let f = Func(f, Box::leak(name.to_string().into_boxed_str()));
        funcs.insert(name.to_string(), f);
        Ok(f)
    }
}

impl Launch for CudaDriver {
    fn describe(&self) -> String {
        self.desc.clone()
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        self.bind()?;
        self.flush()?;
        let s = self.stream.cu_stream();
        // SAFETY: a fresh allocation on our stream, zeroed on the same stream before any use.
        unsafe {
            let p = result::malloc_async(s, bytes.max(1))
                .map_err(|e| anyhow!("allocating {bytes} bytes of GPU memory: {}", cu(&e)))?;
            result::memset_d8_async(p, 0, bytes.max(1), s)
                .map_err(|e| anyhow!("zeroing GPU memory: {}", cu(&e)))?;
            Ok(p)
        }
    }

    fn free(&self, ptr: u64) {
        // A failed flush leaves the queue empty and the stream broken; the next call reports it.
        if self.bind().is_ok() && self.flush().is_ok() {
            // SAFETY: ptr came from `alloc` and is freed once (DevBuf's drop), stream-ordered
            // after every queued use.
            let _ = unsafe { result::free_async(ptr, self.stream.cu_stream()) };
        }
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.bind()?;
        self.flush()?;
        // SAFETY: dst holds at least src.len() bytes (callers size buffers from the data); a
        // copy from pageable memory returns only once src has been staged.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("copying {} bytes to the GPU: {}", src.len(), cu(&e)))
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        self.flush()?;
        // SAFETY: src holds at least dst.len() bytes; the stream is synchronized before dst is
        // read.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("copying {} bytes from the GPU: {}", dst.len(), cu(&e)))?;
        self.sync()
    }

    fn launch(&self, name: &str, grid: [u32; 3], block: [u32; 3], args: &[Arg]) -> Result<()> {
        self.bind()?;
        let f = self.func(name)?;
        let mut profile = self.profile.lock().unwrap_or_else(|p| p.into_inner());
        let timed = match profile.as_mut() {
            Some(p) => {
                self.flush()?; // nothing is queued while profiling, but a run may be pending
                let ev = || {
                    self.ctx
                        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                        .map_err(|e| anyhow!("creating a CUDA event: {}", cu(&e)))
                };
                let (start, end) = (ev()?, ev()?);
                start
                    .record(&self.stream)
                    .map_err(|e| anyhow!("recording a CUDA event: {}", cu(&e)))?;
                Some((p, start, end))
            }
            None => None,
        };
        if let (Some(g), None) = (&self.graphs, &timed) {
            g.lock().unwrap_or_else(|p| p.into_inner()).push(Queued {
                name: f.1,
                func: f.0,
                grid,
                block,
                args: args.iter().map(|a| a.bits()).collect(),
            });
            return Ok(());
        }
        let mut slots: Vec<u64> = args.iter().map(|a| a.bits()).collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: `args` follow the kernel's C signature (ops.rs is the one place that spells
        // them); each parameter is read from its 8-byte little-endian slot during the call.
        unsafe {
            result::launch_kernel(
                f.0,
                (grid[0], grid[1], grid[2]),
                (block[0], block[1], block[2]),
                0,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| anyhow!("launching {name}: {}", cu(&e)))?;
        if let Some((p, start, end)) = timed {
            end.record(&self.stream)
                .map_err(|e| anyhow!("recording a CUDA event: {}", cu(&e)))?;
            p.push(Profiled {
                name: f.1,
                grid,
                args: args.to_vec(),
                start,
                end,
            });
        }
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        self.bind()?;
        self.flush()?;
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("CUDA stream: {}", cu(&e)))
    }

    fn mem_info(&self) -> Option<(usize, usize)> {
        self.ctx.mem_get_info().ok()
    }

    fn profile_start(&self) -> bool {
        *self.profile.lock().unwrap_or_else(|p| p.into_inner()) = Some(Vec::new());
        true
    }

    fn profile_stop(&self) -> Result<Vec<Timed>> {
        let runs = self
            .profile
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        self.sync()?;
        let mut out = Vec::new();
        for p in runs.unwrap_or_default() {
            let ms = p
                .start
                .elapsed_ms(&p.end)
                .map_err(|e| anyhow!("timing {}: {}", p.name, cu(&e)))?;
            out.push(Timed {
                name: p.name.to_string(),
                grid: p.grid,
                args: p.args,
                secs: ms as f64 / 1e3,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::pdl_choice;

    #[test]
    fn pdl_only_when_asked_and_possible() {
        // Off unless asked for, whatever the device.
        assert_eq!(pdl_choice(None, true, 9, 12080), Ok(false));
        assert_eq!(pdl_choice(Some("0"), true, 9, 12080), Ok(false));
        assert_eq!(pdl_choice(Some("yes"), true, 9, 12080), Ok(false));
        // Asked for on an H100/H200 with a 12.3+ (or 13.x) driver.
        assert_eq!(pdl_choice(Some("1"), true, 9, 12030), Ok(true));
        assert_eq!(pdl_choice(Some("1"), true, 10, 13000), Ok(true));
        // Asked for where it cannot be: said why.
        let e = pdl_choice(Some("1"), true, 8, 12080).unwrap_err();
        assert!(e.contains("compute capability 8.x"), "{e}");
        let e = pdl_choice(Some("1"), true, 9, 12020).unwrap_err();
        assert!(e.contains("CUDA 12.2"), "{e}");
        let e = pdl_choice(Some("1"), false, 9, 12080).unwrap_err();
        assert!(e.contains("INFER_CUDA_GRAPHS=0"), "{e}");
    }
}
