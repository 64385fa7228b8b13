//! Test doubles shared by every crate's tests (feature `testing`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A size-limited tmpfs mounted at a directory, unmounted on drop: a small disk that fills up,
/// for full-disk tests. Mounting needs root; this project's machines and CI run tests as root,
/// and elsewhere the test fails saying so rather than passing without testing anything.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs of `size` (as `mount -o size=` takes it: `4m`, `512k`) at `dir`,
    /// creating the directory.
    pub fn new(dir: impl Into<PathBuf>, size: &str) -> Self {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).expect("create the tmpfs mount point");
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .expect("run mount");
        assert!(ok.success(), "mount -t tmpfs needs root (full-disk tests fill a small tmpfs)");
        Tmpfs(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}
