//! The virtio-blk device model: feature bits, configuration space and request
//! parsing. Nothing here knows about threads, sockets or backends.

pub mod request;

/// Request types (virtio spec 1.2, 5.2.6).
pub mod req_type {
    /// Read (device writes guest memory).
    pub const IN: u32 = 0;
    /// Write.
    pub const OUT: u32 = 1;
    /// Flush the volatile write cache.
    pub const FLUSH: u32 = 4;
    /// Read the device serial (20 bytes).
    pub const GET_ID: u32 = 8;
    /// Discard (unmap) sectors.
    pub const DISCARD: u32 = 11;
    /// Write zeroes, optionally unmapping.
    pub const WRITE_ZEROES: u32 = 13;
}

/// Status byte values (virtio spec 1.2, 5.2.6).
pub mod status {
    /// Success.
    pub const OK: u8 = 0;
    /// Device or driver error.
    pub const IOERR: u8 = 1;
    /// Request type not supported.
    pub const UNSUPP: u8 = 2;
}

/// Feature bits we offer (virtio spec 1.2, 5.2.3, 6 and 2.7).
pub mod features {
    /// Maximum size of any single segment is in `size_max`.
    pub const BLK_SIZE_MAX: u64 = 1 << 1;
    /// Maximum number of segments in a request is in `seg_max`.
    pub const BLK_SEG_MAX: u64 = 1 << 2;
    /// Device is read-only.
    pub const BLK_RO: u64 = 1 << 5;
    /// Block size of disk is in `blk_size`.
    pub const BLK_BLK_SIZE: u64 = 1 << 6;
    /// Cache flush command support.
    pub const BLK_FLUSH: u64 = 1 << 9;
    /// Device exports information on optimal I/O alignment.
    pub const BLK_TOPOLOGY: u64 = 1 << 10;
    /// Device can toggle its cache between writeback and writethrough modes.
    pub const BLK_CONFIG_WCE: u64 = 1 << 11;
    /// Device supports multiqueue.
    pub const BLK_MQ: u64 = 1 << 12;
    /// Device can support discard command.
    pub const BLK_DISCARD: u64 = 1 << 13;
    /// Device can support write zeroes command.
    pub const BLK_WRITE_ZEROES: u64 = 1 << 14;
    /// Indirect descriptors.
    pub const RING_INDIRECT_DESC: u64 = 1 << 28;
    /// used_event / avail_event notification suppression.
    pub const RING_EVENT_IDX: u64 = 1 << 29;
    /// vhost-user: protocol feature negotiation (bit 30).
    pub const VHOST_USER_PROTOCOL_FEATURES: u64 = 1 << 30;
    /// Compliance with virtio 1.x.
    pub const VERSION_1: u64 = 1 << 32;
}

/// Logical sector size of the virtio-blk protocol: offsets are in 512-byte units.
pub const SECTOR_SIZE: u64 = 512;
/// Length of the GET_ID answer.
pub const ID_BYTES: usize = 20;
/// Size of the config space we expose (through `write_zeroes_may_unmap` and padding).
pub const CONFIG_SPACE_SIZE: usize = 60;
/// Offset of the `writeback` byte in the config space.
pub const CONFIG_WRITEBACK_OFFSET: usize = 32;

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
    pub fn config_space(&self, writeback: bool) -> [u8; CONFIG_SPACE_SIZE] {
        let mut c = [0u8; CONFIG_SPACE_SIZE];
        c[0..8].copy_from_slice(&self.capacity_sectors.to_le_bytes());
        c[8..12].copy_from_slice(&self.size_max.to_le_bytes());
        c[12..16].copy_from_slice(&self.seg_max.to_le_bytes());
        // 16..20: geometry (cylinders, heads, sectors): not offered.
        c[20..24].copy_from_slice(&self.blk_size.to_le_bytes());
        // topology: physical_block_exp, alignment_offset, min_io_size (in
        // logical blocks), opt_io_size (in logical blocks).
        c[24] = self.physical_block_exp;
        c[25] = 0;
        c[26..28].copy_from_slice(&1u16.to_le_bytes());
        c[28..32].copy_from_slice(&0u32.to_le_bytes());
        c[CONFIG_WRITEBACK_OFFSET] = writeback as u8;
        c[34..36].copy_from_slice(&self.num_queues.to_le_bytes());
        c[36..40].copy_from_slice(&self.max_discard_sectors.to_le_bytes());
        c[40..44].copy_from_slice(&1u32.to_le_bytes()); // max_discard_seg
        let align = self.blk_size / SECTOR_SIZE as u32;
        c[44..48].copy_from_slice(&align.max(1).to_le_bytes()); // discard_sector_alignment
        c[48..52].copy_from_slice(&self.max_write_zeroes_sectors.to_le_bytes());
        c[52..56].copy_from_slice(&1u32.to_le_bytes()); // max_write_zeroes_seg
        c[56] = self.write_zeroes_may_unmap as u8;
        c
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
        let c = geo().config_space(true);
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), 126);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 512);
        assert_eq!(c[24], 3);
        assert_eq!(c[32], 1);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 4);
        assert_eq!(u32::from_le_bytes(c[40..44].try_into().unwrap()), 1);
        assert_eq!(c[56], 1);
        assert_eq!(geo().config_space(false)[32], 0);
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
