//! Children get stdin, stdout and stderr, and none of our other descriptors.
//!
//! Rust opens every descriptor close-on-exec, but the C libraries in this
//! process need not: librdkafka's mock cluster (the embedded Kafka, and the
//! tests' broker) accepts its connections without `CLOEXEC`. A child forked
//! while such a connection is open keeps a copy of the broker's end of it.
//! When the broker later closes the connection (a broker taken down in a
//! test), the client never sees the close, because the copy keeps the socket
//! open: its requests go unanswered until they time out, and a consumer group
//! stalls for a minute. The e2e outage test caught this under load.
//!
//! The workspace denies unsafe code; this module needs it for `pre_exec`
//! and three system calls the standard library does not wrap.
#![allow(unsafe_code)]

use std::os::unix::process::CommandExt;

/// Makes every descriptor above stderr close at `exec` in the children
/// `cmd` spawns (stdio, set up before, is kept).
pub fn only_stdio(cmd: &mut std::process::Command) -> &mut std::process::Command {
    // SAFETY: between fork and exec the closure makes only system calls
    // (close_range, getrlimit, fcntl), which are async-signal-safe, and
    // allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            close_on_exec_from(3);
            Ok(())
        })
    }
}

/// The same for a tokio command.
pub fn only_stdio_tokio(cmd: &mut tokio::process::Command) -> &mut tokio::process::Command {
    only_stdio(cmd.as_std_mut());
    cmd
}

fn close_on_exec_from(first: u32) {
    // One call on Linux 5.11 and later.
    // SAFETY: a plain system call on integers.
    if unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) } == 0 {
        return;
    }
    close_on_exec_each_from(first);
}

/// Older kernels: each descriptor up to the process's limit.
fn close_on_exec_each_from(first: u32) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct it is given.
    let last = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        limit.rlim_cur.min(65_536) as i32
    } else {
        1024
    };
    for fd in first as i32..last {
        // SAFETY: fcntl on a descriptor that is not open fails with EBADF, harmlessly.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// The descriptors a child of `cmd` has open, read from its own /proc.
    fn child_fds(cmd: &mut std::process::Command) -> Vec<i32> {
        let out = cmd.arg("-c").arg("ls /proc/$$/fd").output().expect("run sh");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap().split_whitespace().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn a_descriptor_opened_without_cloexec_reaches_a_plain_child_but_not_a_sealed_one() {
        // A socket as a C library would open it: without SOCK_CLOEXEC.
        // SAFETY: plain system calls; the descriptor is closed below.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
        assert!(fd > 2, "socket: {}", std::io::Error::last_os_error());
        let devnull = std::fs::File::open("/dev/null").unwrap(); // close-on-exec, as Rust opens files

        let plain = child_fds(&mut std::process::Command::new("sh"));
        assert!(plain.contains(&fd), "the plain child inherits {fd}: {plain:?}");
        assert!(!plain.contains(&devnull.as_raw_fd()), "{plain:?}");

        let sealed = child_fds(only_stdio(&mut std::process::Command::new("sh")));
        assert!(!sealed.contains(&fd), "the sealed child still has {fd}: {sealed:?}");
        assert!([0, 1, 2].iter().all(|f| sealed.contains(f)), "stdio is kept: {sealed:?}");

        // The loop for kernels without close_range does the same.
        let mut cmd = std::process::Command::new("sh");
        // SAFETY: as in only_stdio.
        unsafe {
            cmd.pre_exec(|| {
                close_on_exec_each_from(3);
                Ok(())
            });
        }
        let looped = child_fds(&mut cmd);
        assert!(!looped.contains(&fd), "{looped:?}");
        // SAFETY: ours to close.
        unsafe { libc::close(fd) };
    }
}
