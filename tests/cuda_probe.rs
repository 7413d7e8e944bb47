//! Device detection never panics and explains itself: with a fake `libcuda.so.1` whose `cuInit`
//! reports no device (built here from tests/fixtures/cuda/fake_libcuda.c with the `cc` crate's
//! compiler, put first on LD_LIBRARY_PATH of a child process), the probe returns an error naming
//! the cause, and `infer run --device auto` falls back to the CPU with one stderr line while
//! `--device cuda` fails cleanly (exit 1, `infer:` message).

mod common;

use std::path::PathBuf;
use std::process::Command;

use infer::kernels::cuda::driver;

/// Builds the fake driver library into its own directory (as libcuda.so.1 and libcuda.so).
fn fake_driver_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fake-libcuda-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let target = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    let cc = cc::Build::new()
        .cargo_metadata(false)
        .cargo_warnings(false)
        .opt_level(0)
        .target(&target)
        .host(&target)
        .try_get_compiler()
        .unwrap();
    let so = dir.join("libcuda.so.1");
    let src = common::fixture("cuda/fake_libcuda.c");
    let st = cc
        .to_command()
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&src)
        .status()
        .unwrap();
    assert!(st.success(), "building the fake libcuda failed");
    std::fs::copy(&so, dir.join("libcuda.so")).unwrap();
    dir
}

/// The child half: runs the probe and prints its outcome.
#[test]
fn probe_child() {
    if std::env::var_os("INFER_PROBE_CHILD").is_none() {
        return; // only meaningful inside probe_reports_no_device_through_a_fake_driver
    }
    match driver::probe() {
        Ok(d) => println!(
            "PROBE ok {}",
            infer::kernels::cuda::launch::Launch::describe(&*d)
        ),
        Err(e) => println!("PROBE err {e:#}"),
    }
}

#[test]
fn probe_reports_no_device_through_a_fake_driver() {
    let dir = fake_driver_dir();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "probe_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("INFER_PROBE_CHILD", "1")
        .env("LD_LIBRARY_PATH", &dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("PROBE err CUDA driver init failed")
            && stdout.contains("CUDA_ERROR_NO_DEVICE"),
        "{stdout}"
    );
}

#[test]
fn probe_without_a_driver_library_is_an_error_not_a_panic() {
    // SAFETY: only dlopen attempts, as the probe itself makes.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    let r = std::panic::catch_unwind(driver::probe).expect("probe must not panic");
    if !present {
        let e = r.err().expect("no driver library, no device");
        assert!(format!("{e:#}").contains("libcuda.so"), "{e:#}");
    }
}
