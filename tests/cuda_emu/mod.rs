//! The CPU emulator as a [`Launch`] for the tests: builds `cuda/kernels.cu` + `cuda/emu/emu.cpp`
//! with the host C++20 compiler (found by the `cc` crate) into a shared library under the test
//! target dir (once per source content: the name carries a hash of every source file), loads it
//! with libloading, and runs kernels through its `infer_emu_launch`. Device memory is host memory
//! (256-byte aligned, zeroed); a launch runs to completion before it returns.
#![allow(dead_code)]

use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{anyhow, bail, Result};
use infer::kernels::cuda::launch::{Arg, Launch};

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    *const u32,
    *const u32,
    u32,
    *mut *mut c_void,
    *mut c_char,
    usize,
) -> i32;

pub struct Emu {
    _lib: libloading::Library,
    launch: LaunchFn,
    allocs: Mutex<HashMap<u64, Layout>>,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every source the emulator library is built from: cuda/*.cu, cuda/*.cuh and cuda/emu/*, in
/// name order (a new kernel file is picked up without listing it here).
fn sources() -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for dir in ["cuda", "cuda/emu"] {
        for e in std::fs::read_dir(root().join(dir))? {
            let p = e?.path();
            let ext = p.extension().and_then(|x| x.to_str()).unwrap_or("");
            if p.is_file() && matches!(ext, "cu" | "cuh" | "h" | "cpp") {
                files.push(p);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Compiles the emulator library if this exact source has not been compiled yet.
fn build() -> Result<PathBuf> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for f in sources()? {
        f.hash(&mut h);
        std::fs::read(&f)?.hash(&mut h);
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let out = dir.join(format!("libinfer-cuda-emu-{:016x}.so", h.finish()));
    if out.exists() {
        return Ok(out);
    }
    let target = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    let compiler = cc::Build::new()
        .cpp(true)
        .cargo_metadata(false)
        .cargo_warnings(false)
        .opt_level(2)
        .target(&target)
        .host(&target)
        .try_get_compiler()?;
    let tmp = dir.join(format!("emu-{}.so.tmp", std::process::id()));
    let cuda = root().join("cuda");
    let status = compiler
        .to_command()
        .args([
            "-std=c++20",
            "-shared",
            "-fPIC",
            "-DINFER_CUDA_EMU",
            "-Wall",
            "-Werror",
            "-Wno-unknown-pragmas",
            "-Wno-clobbered",
        ])
        .arg(format!("-I{}", cuda.display()))
        .arg("-o")
        .arg(&tmp)
        .arg(cuda.join("emu/emu.cpp"))
        .args(["-x", "c++"])
        .arg(cuda.join("kernels.cu"))
        .arg(cuda.join("emu/selftest.cu"))
        .status()?;
    if !status.success() {
        bail!("compiling the CUDA emulator failed ({status})");
    }
    std::fs::rename(&tmp, &out)?; // atomic: concurrent test binaries may race here
    Ok(out)
}

/// The emulator, built and loaded once per test binary.
pub fn emulator() -> Arc<dyn Launch> {
    static EMU: OnceLock<Arc<Emu>> = OnceLock::new();
    let e =
        EMU.get_or_init(|| Arc::new(Emu::open(&build().expect("building the emulator")).unwrap()));
    Arc::clone(e) as Arc<dyn Launch>
}

impl Emu {
    fn open(path: &Path) -> Result<Emu> {
        // SAFETY: our own library, built just above from this repository's sources; its static
        // initialisers only fill the kernel registry.
        let lib = unsafe { libloading::Library::new(path)? };
        // SAFETY: the symbol has exactly this signature in emu.cpp.
        let launch = unsafe { *lib.get::<LaunchFn>(b"infer_emu_launch\0")? };
        Ok(Emu {
            _lib: lib,
            launch,
            allocs: Mutex::new(HashMap::new()),
        })
    }
}

impl Launch for Emu {
    fn describe(&self) -> String {
        "CPU emulator".into()
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        let layout = Layout::from_size_align(bytes.max(1), 256)?;
        // SAFETY: a non-zero-sized layout.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            bail!("out of host memory for {bytes} bytes");
        }
        self.allocs.lock().unwrap().insert(p as u64, layout);
        Ok(p as u64)
    }

    fn free(&self, ptr: u64) {
        if let Some(layout) = self.allocs.lock().unwrap().remove(&ptr) {
            // SAFETY: allocated by `alloc` with this layout, freed once (removed from the map).
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        }
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: dst is an allocation of at least src.len() bytes (callers size from the data).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: src is an allocation of at least dst.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn launch(&self, name: &str, grid: [u32; 3], block: [u32; 3], args: &[Arg]) -> Result<()> {
        let mut slots: Vec<u64> = args.iter().map(|a| a.bits()).collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        let cname = CString::new(name)?;
        let mut err = vec![0u8; 512];
        // SAFETY: the argument list follows the kernel's signature (ops.rs); pointers in it are
        // live allocations of this emulator; `err` has the stated length.
        let rc = unsafe {
            (self.launch)(
                cname.as_ptr(),
                grid.as_ptr(),
                block.as_ptr(),
                0,
                params.as_mut_ptr(),
                err.as_mut_ptr() as *mut c_char,
                err.len(),
            )
        };
        if rc != 0 {
            let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
            return Err(anyhow!("{name}: {}", String::from_utf8_lossy(&err[..end])));
        }
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }
}
