//! The virtio-blk device model: feature bits, configuration space, request
//! parsing ([`request`]) and what the device does with a request
//! ([`device`]: the block operation it becomes, GET_ID). Nothing here knows
//! about threads, sockets or files; it speaks the block layer's vocabulary
//! (`block::IoKind`) but never calls a backend.

pub mod device;
pub mod request;

use virtio_bindings::virtio_blk::virtio_blk_config;
use vm_memory::ByteValued;

/// Request types (virtio spec 1.2, 5.2.6), from virtio-bindings.
pub mod req_type {
    pub use virtio_bindings::virtio_blk::{
        VIRTIO_BLK_T_DISCARD as DISCARD, VIRTIO_BLK_T_FLUSH as FLUSH,
        VIRTIO_BLK_T_GET_ID as GET_ID, VIRTIO_BLK_T_IN as IN, VIRTIO_BLK_T_OUT as OUT,
        VIRTIO_BLK_T_WRITE_ZEROES as WRITE_ZEROES,
    };
}

/// Status byte values (virtio spec 1.2, 5.2.6), from virtio-bindings.
pub mod status {
    use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP};
    /// Success.
    pub const OK: u8 = VIRTIO_BLK_S_OK as u8;
    /// Device or driver error.
    pub const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
    /// Request type not supported.
    pub const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;
}

/// Feature bits we offer (virtio spec 1.2, 5.2.3, 6 and 2.7), as masks of the
/// virtio-bindings bit numbers.
pub mod features {
    use virtio_bindings::virtio_blk::*;
    use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
    use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

    /// Maximum size of any single segment is in `size_max`.
    pub const BLK_SIZE_MAX: u64 = 1 << VIRTIO_BLK_F_SIZE_MAX;
    /// Maximum number of segments in a request is in `seg_max`.
    pub const BLK_SEG_MAX: u64 = 1 << VIRTIO_BLK_F_SEG_MAX;
    /// Device is read-only.
    pub const BLK_RO: u64 = 1 << VIRTIO_BLK_F_RO;
    /// Block size of disk is in `blk_size`.
    pub const BLK_BLK_SIZE: u64 = 1 << VIRTIO_BLK_F_BLK_SIZE;
    /// Cache flush command support.
    pub const BLK_FLUSH: u64 = 1 << VIRTIO_BLK_F_FLUSH;
    /// Device exports information on optimal I/O alignment.
    pub const BLK_TOPOLOGY: u64 = 1 << VIRTIO_BLK_F_TOPOLOGY;
    /// Device can toggle its cache between writeback and writethrough modes.
    pub const BLK_CONFIG_WCE: u64 = 1 << VIRTIO_BLK_F_CONFIG_WCE;
    /// Device supports multiqueue.
    pub const BLK_MQ: u64 = 1 << VIRTIO_BLK_F_MQ;
    /// Device can support discard command.
    pub const BLK_DISCARD: u64 = 1 << VIRTIO_BLK_F_DISCARD;
    /// Device can support write zeroes command.
    pub const BLK_WRITE_ZEROES: u64 = 1 << VIRTIO_BLK_F_WRITE_ZEROES;
    /// Indirect descriptors.
    pub const RING_INDIRECT_DESC: u64 = 1 << VIRTIO_RING_F_INDIRECT_DESC;
    /// used_event / avail_event notification suppression.
    pub const RING_EVENT_IDX: u64 = 1 << VIRTIO_RING_F_EVENT_IDX;
    /// vhost-user: protocol feature negotiation (bit 30).
    pub const VHOST_USER_PROTOCOL_FEATURES: u64 =
        vhost::vhost_user::message::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    /// Compliance with virtio 1.x.
    pub const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
}

/// Logical sector size of the virtio-blk protocol: offsets are in 512-byte units.
pub const SECTOR_SIZE: u64 = 512;
/// Length of the GET_ID answer.
pub const ID_BYTES: usize = 20;
/// Size of the config space we expose (through `write_zeroes_may_unmap` and
/// padding; the secure-erase and zoned fields after it are not offered).
pub const CONFIG_SPACE_SIZE: usize =
    std::mem::offset_of!(virtio_blk_config, max_secure_erase_sectors);
/// Offset of the `writeback` byte in the config space.
pub const CONFIG_WRITEBACK_OFFSET: usize = std::mem::offset_of!(virtio_blk_config, wce);

/// `struct virtio_blk_config` (virtio spec 1.2, 5.2.4) as virtio-bindings
/// lays it out, readable as bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
#[repr(transparent)]
pub struct BlkConfig(pub virtio_blk_config);

// SAFETY: `virtio_blk_config` is a `repr(C, packed)` struct of integers and
// integer arrays only: it has no padding and every bit pattern is valid.
unsafe impl ByteValued for BlkConfig {}

impl BlkConfig {
    /// The bytes the guest sees (the first [`CONFIG_SPACE_SIZE`]).
    pub fn bytes(&self) -> &[u8] {
        &self.as_slice()[..CONFIG_SPACE_SIZE]
    }
}

/// Device limits, the values behind the configuration space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlkGeometry {
    /// Capacity in 512-byte sectors.
    pub capacity_sectors: u64,
    /// Logical block size the guest should use.
    pub blk_size: u32,
    /// Physical block size exponent (physical = logical << exp).
    pub physical_block_exp: u8,
    /// Largest data segment, bytes.
    pub size_max: u32,
    /// Most data segments per request.
    pub seg_max: u32,
    /// Number of request queues.
    pub num_queues: u16,
    /// Largest discard, in sectors.
    pub max_discard_sectors: u32,
    /// Largest write-zeroes, in sectors.
    pub max_write_zeroes_sectors: u32,
    /// Whether write-zeroes with UNMAP may deallocate.
    pub write_zeroes_may_unmap: bool,
    /// Export is read-only.
    pub read_only: bool,
}

impl BlkGeometry {
    /// The virtio-blk feature bits for this device.
    pub fn features(&self) -> u64 {
        use features::*;
        let mut f = VERSION_1
            | RING_INDIRECT_DESC
            | RING_EVENT_IDX
            | VHOST_USER_PROTOCOL_FEATURES
            | BLK_SIZE_MAX
            | BLK_SEG_MAX
            | BLK_BLK_SIZE
            | BLK_TOPOLOGY
            | BLK_FLUSH
            | BLK_CONFIG_WCE
            | BLK_MQ;
        if self.read_only {
            f |= BLK_RO;
        } else {
            f |= BLK_DISCARD | BLK_WRITE_ZEROES;
        }
        f
    }

    /// The limits the request parser enforces: exactly what the config space
    /// advertises.
    pub fn limits(&self) -> request::Limits {
        request::Limits {
            capacity_sectors: self.capacity_sectors,
            seg_max: self.seg_max,
            size_max: self.size_max,
            max_discard_sectors: self.max_discard_sectors,
            max_write_zeroes_sectors: self.max_write_zeroes_sectors,
            read_only: self.read_only,
        }
    }

    /// The config space (virtio spec 1.2, 5.2.4, `struct virtio_blk_config`),
    /// little-endian, with the given `writeback` byte.
    pub fn config_space(&self, writeback: bool) -> BlkConfig {
        let align = (self.blk_size / SECTOR_SIZE as u32).max(1);
        BlkConfig(virtio_blk_config {
            capacity: self.capacity_sectors.to_le(),
            size_max: self.size_max.to_le(),
            seg_max: self.seg_max.to_le(),
            // geometry (cylinders, heads, sectors): not offered.
            blk_size: self.blk_size.to_le(),
            // topology: min_io_size and opt_io_size in logical blocks.
            physical_block_exp: self.physical_block_exp,
            alignment_offset: 0,
            min_io_size: 1u16.to_le(),
            opt_io_size: 0,
            wce: writeback as u8,
            num_queues: self.num_queues.to_le(),
            max_discard_sectors: self.max_discard_sectors.to_le(),
            max_discard_seg: 1u32.to_le(),
            discard_sector_alignment: align.to_le(),
            max_write_zeroes_sectors: self.max_write_zeroes_sectors.to_le(),
            max_write_zeroes_seg: 1u32.to_le(),
            write_zeroes_may_unmap: self.write_zeroes_may_unmap as u8,
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> BlkGeometry {
        BlkGeometry {
            capacity_sectors: 2048,
            blk_size: 512,
            physical_block_exp: 3,
            size_max: 1 << 20,
            seg_max: 126,
            num_queues: 4,
            max_discard_sectors: 1 << 20,
            max_write_zeroes_sectors: 1 << 20,
            write_zeroes_may_unmap: true,
            read_only: false,
        }
    }

    #[test]
    fn config_space_layout() {
        let cfg = geo().config_space(true);
        let c = cfg.bytes();
        assert_eq!(c.len(), 60);
        assert_eq!(CONFIG_WRITEBACK_OFFSET, 32);
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(c[8..12].try_into().unwrap()), 1 << 20);
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), 126);
        assert_eq!(&c[16..20], &[0; 4]); // no geometry
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 512);
        assert_eq!(c[24], 3);
        assert_eq!(c[25], 0);
        assert_eq!(u16::from_le_bytes(c[26..28].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(c[28..32].try_into().unwrap()), 0);
        assert_eq!(c[32], 1);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 4);
        assert_eq!(u32::from_le_bytes(c[36..40].try_into().unwrap()), 1 << 20);
        assert_eq!(u32::from_le_bytes(c[40..44].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(c[44..48].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(c[48..52].try_into().unwrap()), 1 << 20);
        assert_eq!(u32::from_le_bytes(c[52..56].try_into().unwrap()), 1);
        assert_eq!(c[56], 1);
        assert_eq!(&c[57..60], &[0; 3]);
        assert_eq!(geo().config_space(false).bytes()[32], 0);
    }

    #[test]
    fn constants_match_the_spec() {
        assert_eq!(
            (
                req_type::IN,
                req_type::OUT,
                req_type::FLUSH,
                req_type::GET_ID
            ),
            (0, 1, 4, 8)
        );
        assert_eq!((req_type::DISCARD, req_type::WRITE_ZEROES), (11, 13));
        assert_eq!((status::OK, status::IOERR, status::UNSUPP), (0, 1, 2));
        assert_eq!(features::BLK_MQ, 1 << 12);
        assert_eq!(features::RING_EVENT_IDX, 1 << 29);
        assert_eq!(features::VHOST_USER_PROTOCOL_FEATURES, 1 << 30);
        assert_eq!(features::VERSION_1, 1 << 32);
    }

    #[test]
    fn read_only_drops_write_features() {
        let mut g = geo();
        assert_eq!(g.features() & features::BLK_RO, 0);
        assert_ne!(g.features() & features::BLK_DISCARD, 0);
        g.read_only = true;
        assert_ne!(g.features() & features::BLK_RO, 0);
        assert_eq!(
            g.features() & (features::BLK_DISCARD | features::BLK_WRITE_ZEROES),
            0
        );
    }
}
