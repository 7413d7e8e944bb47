//! Device detection never panics and explains itself: with a fake `libcuda.so.1` whose `cuInit`
//! reports no device (built here from tests/fixtures/cuda/fake_libcuda.c with the `cc` crate's
//! compiler, put first on LD_LIBRARY_PATH of the real binary), `infer run --device auto` falls
//! back to the CPU with one stderr line saying why, `--device cuda` and `infer selftest` fail
//! cleanly (exit 1, `infer:` message, no panic).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

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

/// Runs the real binary with the fake driver first on the library path.
fn infer_with_fake_driver(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_infer"))
        .args(args)
        .env("LD_LIBRARY_PATH", dir)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn no_device_falls_back_to_the_cpu_or_fails_cleanly() {
    let dir = fake_driver_dir();
    let m = common::model(common::GEMMA);
    let m = m.to_str().unwrap();
    let run = |device: &str| {
        let args = [
            "run", "-m", m, "-p", "Hello", "-n", "3", "--temp", "0", "--device", device,
        ];
        infer_with_fake_driver(&dir, &args)
    };
    let cpu = run("cpu");
    assert!(cpu.status.success(), "{}", common::stderr(&cpu));
    assert!(
        !common::stderr(&cpu).contains("CUDA"),
        "{}",
        common::stderr(&cpu)
    );

    // auto: one line saying why, then the same output as --device cpu
    let auto = run("auto");
    let err = common::stderr(&auto);
    assert!(auto.status.success(), "{err}");
    let why: Vec<&str> = err.lines().filter(|l| l.contains("CUDA")).collect();
    assert_eq!(
        why,
        ["infer: running on the CPU: CUDA driver init failed: CUDA_ERROR_NO_DEVICE"],
        "{err}"
    );
    assert_eq!(auto.stdout, cpu.stdout);

    // cuda: an error, exit 1, no panic
    let cuda = run("cuda");
    let err = common::stderr(&cuda);
    assert_eq!(cuda.status.code(), Some(1), "{err}");
    assert!(err.starts_with("infer: --device cuda: no usable CUDA device: CUDA driver init failed: CUDA_ERROR_NO_DEVICE"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    let st = infer_with_fake_driver(&dir, &["selftest"]);
    let err = common::stderr(&st);
    assert_eq!(st.status.code(), Some(1), "{err}");
    assert!(
        err.contains("selftest needs a usable CUDA device: CUDA driver init failed"),
        "{err}"
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
