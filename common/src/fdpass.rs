//! Passing file descriptors over a Unix stream socket (SCM_RIGHTS): how a worker hands a
//! co-located client a block file or a sealed shared-memory copy (short-circuit reads), and how
//! the client receives it. Both sides use these functions, so the framing of a descriptor (it
//! travels with the first byte of the bytes it is sent with) is defined once.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::UnixStream;

/// Most descriptors one `recvmsg` accepts; a peer sending more is misbehaving, and the extra
/// ones are closed.
const MAX_FDS: usize = 8;
/// Sends `bytes` with `pass` attached (SCM_RIGHTS) on a connected Unix stream socket; returns
/// how many bytes went (the descriptor goes with the first of them). Non-blocking sockets give
/// `WouldBlock` as usual.
pub fn send_with_fd(socket: BorrowedFd<'_>, bytes: &[u8], pass: BorrowedFd<'_>) -> io::Result<usize> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    // u64 words: the control buffer must be aligned for cmsghdr.
    let mut control = [0u64; 8];
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let space = unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as usize;
    debug_assert!(space <= size_of_val(&control));
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points at `space` writable, aligned bytes, enough for one header and
    // one descriptor, so CMSG_FIRSTHDR is non-null and CMSG_DATA has room for a c_int.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), pass.as_raw_fd());
    }
    // SAFETY: msg and everything it points at outlive the call; MSG_NOSIGNAL turns a closed
    // peer into EPIPE instead of killing the process.
    let n = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// Receives into `buf`; descriptors that arrived with the bytes are appended to `fds` (owned,
/// close-on-exec). Returns the bytes read (0 at end of stream). Descriptors the control buffer
/// could not hold are an error: the kernel closed them and the peer is misbehaving.
pub fn recv_with_fds(socket: BorrowedFd<'_>, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut control = [0u64; 16];
    // SAFETY: see send_with_fd.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<RawFd>()) as u32) } as usize;
    debug_assert!(space <= size_of_val(&control));
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points at a writable buffer and control area that outlive the call.
    let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled msg_controllen bytes of well-formed control messages; the
    // CMSG_* walk stays inside them, and every SCM_RIGHTS descriptor is new and ours to own.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let payload = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..payload / size_of::<libc::c_int>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other("more file descriptors than expected were passed"));
    }
    Ok(n as usize)
}

/// Writes all of `bytes` with `pass` attached to the first of them.
pub async fn write_all_with_fd(
    stream: &mut UnixStream,
    bytes: &[u8],
    pass: BorrowedFd<'_>,
) -> io::Result<()> {
    if bytes.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a descriptor needs at least one byte"));
    }
    let sent = stream.async_io(Interest::WRITABLE, || send_with_fd(stream.as_fd(), bytes, pass)).await?;
    if sent == 0 {
        return Err(io::ErrorKind::WriteZero.into());
    }
    stream.write_all(&bytes[sent..]).await
}

/// Fills `buf`, collecting every descriptor that arrives with its bytes into `fds`.
pub async fn read_exact_with_fds(
    stream: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let n = stream
            .async_io(Interest::READABLE, || recv_with_fds(stream.as_fd(), &mut buf[got..], fds))
            .await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::{Seek, Write};

    use tokio::io::AsyncWriteExt;

    use super::*;

    fn pair() -> (UnixStream, UnixStream) {
        UnixStream::pair().unwrap()
    }

    fn file_with(bytes: &[u8]) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        f.rewind().unwrap();
        f
    }

    #[tokio::test]
    async fn a_descriptor_travels_with_the_first_byte_and_names_the_same_file() {
        let (mut a, b) = pair();
        let file = file_with(b"hello, block");
        write_all_with_fd(&mut a, b"0123456789", file.as_fd()).await.unwrap();
        let mut fds = Vec::new();
        let mut first = [0u8; 4];
        read_exact_with_fds(&b, &mut first, &mut fds).await.unwrap();
        assert_eq!(&first, b"0123");
        assert_eq!(fds.len(), 1, "the descriptor arrives with the first bytes");
        let mut rest = [0u8; 6];
        read_exact_with_fds(&b, &mut rest, &mut fds).await.unwrap();
        assert_eq!(&rest, b"456789");
        assert_eq!(fds.len(), 1, "and only once");
        let got = File::from(fds.pop().unwrap());
        let mut buf = [0u8; 12];
        std::os::unix::fs::FileExt::read_exact_at(&got, &mut buf, 0).unwrap();
        assert_eq!(&buf, b"hello, block");
    }

    #[tokio::test]
    async fn plain_bytes_carry_no_descriptor_and_eof_is_an_error() {
        let (mut a, b) = pair();
        a.write_all(b"xy").await.unwrap();
        drop(a);
        let mut fds = Vec::new();
        let mut buf = [0u8; 2];
        read_exact_with_fds(&b, &mut buf, &mut fds).await.unwrap();
        assert!(fds.is_empty());
        let err = read_exact_with_fds(&b, &mut buf, &mut fds).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[tokio::test]
    async fn sending_a_descriptor_to_a_closed_peer_fails_without_a_signal() {
        let (mut a, b) = pair();
        drop(b);
        let file = file_with(b"x");
        assert!(write_all_with_fd(&mut a, b"abc", file.as_fd()).await.is_err());
    }
}
