//! Writing safetensors headers for responses.
//!
//! polyak never builds a whole safetensors file in memory: it writes the
//! header computed here, then streams each tensor's bytes straight from
//! where they live (an engine buffer copy, a snapshot file).

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::DType;

/// One tensor of a file being written, in data order.
#[derive(Debug, Clone)]
pub struct HeaderEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub nbytes: usize,
}

/// A safetensors header: the 8-byte length, the JSON, padded with spaces so
/// that the data starts at a multiple of 8 (as the reference writer does).
#[derive(Debug, Clone)]
pub struct SafetensorsHeader {
    bytes: Vec<u8>,
    data_len: u64,
}

impl SafetensorsHeader {
    /// Lays the entries out back to back in the given order.
    pub fn new(entries: Vec<HeaderEntry>, metadata: BTreeMap<String, String>) -> Self {
        let mut map = Map::new();
        if !metadata.is_empty() {
            map.insert("__metadata__".into(), json!(metadata));
        }
        let mut offset = 0u64;
        for e in entries {
            let end = offset + e.nbytes as u64;
            map.insert(
                e.name,
                json!({"dtype": e.dtype.safetensors_name(), "shape": e.shape, "data_offsets": [offset, end]}),
            );
            offset = end;
        }
        let mut text = Value::Object(map).to_string().into_bytes();
        let padded = text.len().div_ceil(8) * 8;
        text.resize(padded, b' ');
        let mut bytes = Vec::with_capacity(8 + text.len());
        bytes.extend_from_slice(&(text.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&text);
        SafetensorsHeader {
            bytes,
            data_len: offset,
        }
    }

    /// The length prefix and the JSON.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// Bytes of tensor data that follow the header.
    pub fn data_len(&self) -> u64 {
        self.data_len
    }

    /// Length of the whole file.
    pub fn file_len(&self) -> u64 {
        self.bytes.len() as u64 + self.data_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_through_the_reference_parser() {
        let header = SafetensorsHeader::new(
            vec![
                HeaderEntry {
                    name: "n".into(),
                    dtype: DType::I64,
                    shape: vec![],
                    nbytes: 8,
                },
                HeaderEntry {
                    name: "w".into(),
                    dtype: DType::F32,
                    shape: vec![3],
                    nbytes: 12,
                },
            ],
            BTreeMap::from([("k".to_string(), "v".to_string())]),
        );
        assert_eq!(header.bytes().len() % 8, 0);
        let mut file = header.bytes().to_vec();
        file.extend_from_slice(&5i64.to_le_bytes());
        for v in [1.0f32, 2.0, 3.0] {
            file.extend_from_slice(&v.to_le_bytes());
        }
        assert_eq!(file.len() as u64, header.file_len());
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        assert_eq!(st.tensor("w").unwrap().shape(), &[3]);
        assert_eq!(st.tensor("n").unwrap().data(), &5i64.to_le_bytes());
        let (_, meta) = safetensors::SafeTensors::read_metadata(&file).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["k"], "v");
    }
}
