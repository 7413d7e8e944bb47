//! The launch interface between the CUDA backend's host logic and whatever runs the kernels: raw
//! device memory (addresses as `u64`), host↔device copies, and kernel launches by name with
//! cuLaunchKernel-style arguments. Implementations order every operation (one stream): a download
//! sees every earlier launch's writes. [`DevBuf`] owns an allocation and frees it on drop.

use std::sync::Arc;

use anyhow::Result;

/// One kernel argument, passed by value as the kernel's C signature declares it.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device address (`T*`).
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    /// The argument's bytes in a little-endian u64 slot (what the kernel reads from its address).
    pub fn bits(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I32(v) => v as u32 as u64,
            Arg::I64(v) => v as u64,
            Arg::F32(v) => v.to_bits() as u64,
        }
    }
}

/// Runs kernels and holds their memory (see the module docs).
pub trait Launch: Send + Sync {
    /// The device in words (for messages and the selftest table).
    fn describe(&self) -> String;
    /// `bytes` of zeroed device memory (at least 256-byte aligned).
    fn alloc(&self, bytes: usize) -> Result<u64>;
    /// Frees memory from `alloc` (after every queued use of it).
    fn free(&self, ptr: u64);
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()>;
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    /// Launches kernel `name` with `grid` × `block` threads.
    fn launch(&self, name: &str, grid: [u32; 3], block: [u32; 3], args: &[Arg]) -> Result<()>;
    /// Waits for everything queued.
    fn sync(&self) -> Result<()>;
    /// (free, total) device memory in bytes, where known.
    fn mem_info(&self) -> Option<(usize, usize)> {
        None
    }
    /// Starts timing every launch on the device, one at a time (`infer bench --profile`); false
    /// where this implementation cannot.
    fn profile_start(&self) -> bool {
        false
    }
    /// Stops timing and returns every launch timed since [`Launch::profile_start`], in order.
    fn profile_stop(&self) -> Result<Vec<Timed>> {
        Ok(Vec::new())
    }
}

/// One launch timed on the device: its kernel, grid, arguments and duration.
#[derive(Clone, Debug)]
pub struct Timed {
    pub name: String,
    pub grid: [u32; 3],
    pub args: Vec<Arg>,
    pub secs: f64,
}

/// Device memory owned by the host side; freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    l: Arc<dyn Launch>,
}

impl DevBuf {
    pub fn new(l: &Arc<dyn Launch>, bytes: usize) -> Result<DevBuf> {
        let ptr = l.alloc(bytes)?;
        Ok(DevBuf {
            ptr,
            bytes,
            l: Arc::clone(l),
        })
    }

    /// A buffer holding `data`.
    pub fn from_bytes(l: &Arc<dyn Launch>, data: &[u8]) -> Result<DevBuf> {
        let b = DevBuf::new(l, data.len())?;
        l.upload(b.ptr, data)?;
        Ok(b)
    }

    pub fn from_f32(l: &Arc<dyn Launch>, data: &[f32]) -> Result<DevBuf> {
        DevBuf::from_bytes(l, &f32_bytes(data))
    }

    pub fn from_i32(l: &Arc<dyn Launch>, data: &[i32]) -> Result<DevBuf> {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        DevBuf::from_bytes(l, &bytes)
    }

    pub fn arg(&self) -> Arg {
        Arg::Ptr(self.ptr)
    }

    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let mut v = vec![0f32; self.bytes / 4];
        // SAFETY: the byte view covers exactly v's memory (u8 has alignment 1) and every byte
        // pattern is a valid f32; the device's little-endian floats are the host's (see below).
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 4) };
        self.l.download(self.ptr, bytes)?;
        Ok(v)
    }

    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; self.bytes];
        self.l.download(self.ptr, &mut bytes)?;
        Ok(bytes)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        self.l.free(self.ptr);
    }
}

// Device values are little-endian; `to_f32` copies them into host floats unchanged.
#[cfg(not(target_endian = "little"))]
compile_error!("the CUDA backend assumes a little-endian host");

pub fn f32_bytes(data: &[f32]) -> Vec<u8> {
    data.iter().flat_map(|v| v.to_le_bytes()).collect()
}
