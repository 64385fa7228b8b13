//! One-sided RDMA READs with libibverbs (feature `rdma`).
//!
//! **Compiled in CI, never run**: the machines this was written on have no RDMA device. What
//! runs in the tests is the same protocol with [`super::EmulatedReader`] in this reader's place.
//!
//! Why `ibverbs-sys` (the raw bindings the `ibverbs` crate is built on) and not `ibverbs`
//! itself: `ibverbs` 0.9.2 posts only SENDs (`QueuePair::post_send` is always `IBV_WR_SEND`)
//! and keeps the queue pair and the region's lkey private, so a READ cannot be posted through
//! it. The worker's side, which only registers memory and connects queue pairs, uses `ibverbs`.
//!
//! Per worker: one reliable-connection (RC) queue pair, connected by an `RdmaConnect` exchange
//! on a dedicated TCP connection that stays open as long as the queue pair (closing it ends the
//! worker's queue pair). One READ at a time per queue pair into a registered buffer that grows
//! to the largest read, polled to completion on a blocking thread, then copied out. A failed
//! or timed-out READ drops the connection (its queue pair is in the error state); the next read
//! connects again.

use std::collections::HashMap;
use std::ffi::c_int;
use std::ptr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use ibverbs_sys as ffi;
use strata_common::frame::{RESPONSE_HEADER_LEN, RdmaEndpoint, ResponseHeader};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::RemoteReader;
use crate::transport::{DataStream, Dial, TransportError, connect_tcp};

const PORT_NUM: u8 = 1;

/// An open device: context, protection domain, port attributes.
struct Device {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    lid: u16,
    active_mtu: ffi::ibv_mtu,
    gid: Option<[u8; 16]>,
}

// SAFETY: libibverbs objects may be used from any thread; the pointers are owned by `Device`
// and freed only in `drop`.
unsafe impl Send for Device {}
// SAFETY: as above; libibverbs verbs are thread-safe.
unsafe impl Sync for Device {}

fn os_err(what: &str) -> std::io::Error {
    let e = std::io::Error::last_os_error();
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn errno_err(what: &str, errno: c_int) -> std::io::Error {
    let e = std::io::Error::from_raw_os_error(errno);
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl Device {
    fn open_first() -> std::io::Result<Self> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed below after opening.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(os_err("listing RDMA devices"));
        }
        // SAFETY: the list holds `n` device pointers; the opened context outlives the list.
        let ctx = unsafe {
            let ctx = if n > 0 { ffi::ibv_open_device(*list) } else { ptr::null_mut() };
            ffi::ibv_free_device_list(list);
            ctx
        };
        if ctx.is_null() {
            return Err(std::io::Error::new(std::io::ErrorKind::NotFound, "no RDMA device"));
        }
        let mut dev = Device { ctx, pd: ptr::null_mut(), lid: 0, active_mtu: ffi::IBV_MTU_1024, gid: None };
        let mut port = ffi::ibv_port_attr::default();
        // SAFETY: `ctx` is open; `port` is a valid out-pointer of the layout the call expects.
        let errno = unsafe { ffi::ibv_query_port(dev.ctx, PORT_NUM, &mut port as *mut _ as *mut _) };
        if errno != 0 {
            return Err(errno_err("querying the RDMA port", errno));
        }
        dev.lid = port.lid;
        dev.active_mtu = port.active_mtu;
        if port.gid_tbl_len > 0 {
            let mut gid = ffi::ibv_gid::default();
            // SAFETY: `ctx` is open, index 0 exists, `gid` is a valid out-pointer.
            if unsafe { ffi::ibv_query_gid(dev.ctx, PORT_NUM, 0, &mut gid) } == 0 {
                // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
                let raw = unsafe { gid.raw };
                dev.gid = (raw != [0; 16]).then_some(raw);
            }
        }
        // SAFETY: `ctx` is open.
        dev.pd = unsafe { ffi::ibv_alloc_pd(dev.ctx) };
        if dev.pd.is_null() {
            return Err(os_err("allocating a protection domain"));
        }
        Ok(dev)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every queue pair, CQ and region of this device holds an `Arc<Device>` and is
        // gone before this runs; the pointers were returned by libibverbs.
        unsafe {
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// A registered local buffer the NIC writes READ results into.
struct LocalBuffer {
    data: Vec<u8>,
    mr: *mut ffi::ibv_mr,
}

impl LocalBuffer {
    fn new(dev: &Device, len: usize) -> std::io::Result<Self> {
        let mut data = vec![0u8; len.max(4096)];
        // SAFETY: `data` lives as long as the registration (deregistered in `drop` first).
        let mr = unsafe {
            ffi::ibv_reg_mr(
                dev.pd,
                data.as_mut_ptr().cast(),
                data.len(),
                ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as c_int,
            )
        };
        if mr.is_null() {
            return Err(os_err("registering the read buffer"));
        }
        Ok(Self { data, mr })
    }
}

impl Drop for LocalBuffer {
    fn drop(&mut self) {
        // SAFETY: `mr` was registered by `new`; no READ into it is outstanding (the queue pair is
        // destroyed first, which flushes any).
        unsafe { ffi::ibv_dereg_mr(self.mr) };
    }
}

/// A queue pair connected to one worker's, with its completion queue and read buffer.
struct QueuePair {
    qp: *mut ffi::ibv_qp,
    cq: *mut ffi::ibv_cq,
    buf: Option<LocalBuffer>,
    dev: Arc<Device>,
    next_wr: u64,
}

// SAFETY: used by one thread at a time (behind a mutex); libibverbs allows any thread.
unsafe impl Send for QueuePair {}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: destroying the queue pair flushes outstanding READs, so the buffer can be
        // deregistered after it; the CQ goes last.
        unsafe {
            if !self.qp.is_null() {
                ffi::ibv_destroy_qp(self.qp);
            }
            self.buf = None;
            if !self.cq.is_null() {
                ffi::ibv_destroy_cq(self.cq);
            }
        }
        let _ = &self.dev;
    }
}

fn modify(
    qp: *mut ffi::ibv_qp,
    attr: &mut ffi::ibv_qp_attr,
    mask: ffi::ibv_qp_attr_mask,
    what: &str,
) -> std::io::Result<()> {
    // SAFETY: `qp` is a live queue pair and `attr` a valid attribute struct.
    let errno = unsafe { ffi::ibv_modify_qp(qp, attr, mask.0 as c_int) };
    if errno == 0 { Ok(()) } else { Err(errno_err(what, errno)) }
}

impl QueuePair {
    /// A new RC queue pair in the INIT state.
    fn create(dev: Arc<Device>) -> std::io::Result<Self> {
        // SAFETY: the context is open; no completion channel.
        let cq = unsafe { ffi::ibv_create_cq(dev.ctx, 16, ptr::null_mut(), ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(os_err("creating a completion queue"));
        }
        let mut qp = QueuePair { qp: ptr::null_mut(), cq, buf: None, dev, next_wr: 1 };
        let mut init = ffi::ibv_qp_init_attr {
            send_cq: cq,
            recv_cq: cq,
            cap: ffi::ibv_qp_cap {
                max_send_wr: 4,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            ..Default::default()
        };
        // SAFETY: the PD and CQ are live; `init` is valid.
        qp.qp = unsafe { ffi::ibv_create_qp(qp.dev.pd, &mut init) };
        if qp.qp.is_null() {
            return Err(os_err("creating a queue pair"));
        }
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT_NUM,
            qp_access_flags: 0,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as m;
        modify(
            qp.qp,
            &mut attr,
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
            "queue pair to INIT",
        )?;
        Ok(qp)
    }

    fn endpoint(&self) -> RdmaEndpoint {
        // SAFETY: `qp` is live.
        let qp_num = unsafe { (*self.qp).qp_num };
        RdmaEndpoint { qp_num, lid: self.dev.lid, gid: self.dev.gid }
    }

    /// INIT → RTR → RTS towards the worker's queue pair; PSNs 0 as the worker's side uses.
    fn connect(&mut self, remote: RdmaEndpoint) -> std::io::Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        let mut rtr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: self.dev.active_mtu,
            dest_qp_num: remote.qp_num,
            rq_psn: 0,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ..Default::default()
        };
        rtr.ah_attr.dlid = remote.lid;
        rtr.ah_attr.port_num = PORT_NUM;
        if let (Some(gid), Some(_)) = (remote.gid, self.dev.gid) {
            rtr.ah_attr.is_global = 1;
            rtr.ah_attr.grh.dgid = ffi::ibv_gid { raw: gid };
            rtr.ah_attr.grh.sgid_index = 0;
            rtr.ah_attr.grh.hop_limit = 0xff;
        }
        modify(
            self.qp,
            &mut rtr,
            m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
            "queue pair to RTR",
        )?;
        let mut rts = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            ..Default::default()
        };
        modify(
            self.qp,
            &mut rts,
            m::IBV_QP_STATE
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_MAX_QP_RD_ATOMIC,
            "queue pair to RTS",
        )
    }

    /// One signaled READ of `len` bytes at `(addr, rkey)`, polled until `deadline`.
    fn read(&mut self, addr: u64, rkey: u32, len: usize, deadline: Instant) -> std::io::Result<Bytes> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        if self.buf.as_ref().is_none_or(|b| b.data.len() < len) {
            self.buf = None;
            self.buf = Some(LocalBuffer::new(&self.dev, len)?);
        }
        let buf = self.buf.as_mut().expect("just set");
        let wr_id = self.next_wr;
        self.next_wr += 1;
        let mut sge = ffi::ibv_sge {
            addr: buf.data.as_mut_ptr() as u64,
            length: u32::try_from(len).map_err(|_| std::io::Error::other("read larger than 4 GiB"))?,
            // SAFETY: `mr` is a live registration.
            lkey: unsafe { (*buf.mr).lkey },
        };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: addr, rkey };
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: `qp` is live and connected; `wr` and `sge` outlive the call; the buffer stays
        // registered until the completion is polled (or the queue pair is destroyed).
        let errno = unsafe {
            let ctx = (*self.qp).context;
            let post = (*ctx).ops.post_send.ok_or_else(|| std::io::Error::other("no post_send"))?;
            post(self.qp, &mut wr, &mut bad)
        };
        if errno != 0 {
            return Err(errno_err("posting the READ", errno));
        }
        let mut wc = [ffi::ibv_wc::default()];
        loop {
            // SAFETY: `cq` is live; `wc` has room for one completion.
            let n = unsafe {
                let ctx = (*self.cq).context;
                let poll = (*ctx).ops.poll_cq.ok_or_else(|| std::io::Error::other("no poll_cq"))?;
                poll(self.cq, 1, wc.as_mut_ptr())
            };
            if n < 0 {
                return Err(std::io::Error::other("polling the completion queue failed"));
            }
            if n == 1 && wc[0].wr_id() == wr_id {
                break;
            }
            if Instant::now() >= deadline {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "READ not completed"));
            }
            std::hint::spin_loop();
        }
        if let Some((status, vendor)) = wc[0].error() {
            return Err(std::io::Error::other(format!(
                "READ failed: status {status}, vendor error {vendor}"
            )));
        }
        Ok(Bytes::copy_from_slice(&buf.data[..len]))
    }
}

/// A connected queue pair and the TCP connection whose lifetime is the worker's queue pair.
struct Connection {
    qp: Mutex<QueuePair>,
    _control: DataStream,
}

/// [`RemoteReader`] posting RDMA READs through the first RDMA device.
pub struct VerbsReader {
    dev: Arc<Device>,
    conns: tokio::sync::Mutex<HashMap<String, Arc<Connection>>>,
    dial: Dial,
    request_timeout: Duration,
}

impl VerbsReader {
    /// Opens the first RDMA device; fails where there is none.
    pub fn open(dial: impl Into<Dial>, request_timeout: Duration) -> std::io::Result<Self> {
        Ok(Self {
            dev: Arc::new(Device::open_first()?),
            conns: tokio::sync::Mutex::new(HashMap::new()),
            dial: dial.into(),
            request_timeout,
        })
    }

    async fn connection(&self, worker: &str) -> Result<Arc<Connection>, TransportError> {
        let mut conns = self.conns.lock().await;
        if let Some(c) = conns.get(worker) {
            return Ok(c.clone());
        }
        let io = |source| TransportError::Io { addr: worker.to_string(), source };
        let mut qp = QueuePair::create(self.dev.clone()).map_err(io)?;
        let request = qp.endpoint().encode_request();
        let mut control = connect_tcp(worker, &self.dial).await?;
        let exchange = async {
            control.write_all(&request).await?;
            control.flush().await?;
            let mut head = [0u8; RESPONSE_HEADER_LEN];
            control.read_exact(&mut head).await?;
            let head = ResponseHeader::decode(&head).map_err(std::io::Error::other)?;
            let len = head.payload_len.min(strata_common::frame::MAX_ERROR_MESSAGE as u64) as usize;
            let mut body = vec![0u8; len];
            control.read_exact(&mut body).await?;
            match head.status {
                Ok(_) => RdmaEndpoint::decode(&body).map_err(std::io::Error::other),
                Err(kind) => Err(std::io::Error::other(format!(
                    "worker refused the queue pair ({kind}): {}",
                    String::from_utf8_lossy(&body)
                ))),
            }
        };
        let remote = tokio::time::timeout(self.request_timeout, exchange)
            .await
            .map_err(|_| TransportError::Timeout { addr: worker.to_string() })?
            .map_err(io)?;
        qp.connect(remote).map_err(io)?;
        let conn = Arc::new(Connection { qp: Mutex::new(qp), _control: control });
        conns.insert(worker.to_string(), conn.clone());
        Ok(conn)
    }
}

#[async_trait]
impl RemoteReader for VerbsReader {
    async fn read(&self, worker: &str, addr: u64, rkey: u32, len: u64) -> Result<Bytes, TransportError> {
        let conn = self.connection(worker).await?;
        let deadline = Instant::now() + self.request_timeout;
        let reading = conn.clone();
        let read = tokio::task::spawn_blocking(move || {
            let mut qp = reading.qp.lock().unwrap_or_else(|p| p.into_inner());
            qp.read(addr, rkey, len as usize, deadline)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        match read {
            Ok(bytes) => Ok(bytes),
            Err(source) => {
                // The queue pair is in the error state (or a READ is still outstanding):
                // drop it, the next read connects again.
                let mut conns = self.conns.lock().await;
                if conns.get(worker).is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                    conns.remove(worker);
                }
                Err(TransportError::Io { addr: worker.to_string(), source })
            }
        }
    }
}
